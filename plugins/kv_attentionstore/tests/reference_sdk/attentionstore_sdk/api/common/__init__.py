# REFERENCE IMPLEMENTATION (not the vendor SDK): package path read at FD line 32.
