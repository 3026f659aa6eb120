"""A third-party backend as it was written against kvcore 0.1, kept as it was.

It uses only what 0.1 offered: the top-level ``kvcore`` names, the three required hooks
returning plain counts, ``kvcore_stats`` and ``kvcore_close``, contiguous host buffers
(``ptrs[i][j]``, ``nbytes[j]``), object names read as rows. No 0.2 or 0.3 hook, no
``Outcome``, no capability declared after 0.1. Its tests
(``test_conformance_backend_written_for_0_1.py``) run today's kit on it unchanged: what 0.1's
authors wrote must keep passing (CHANGELOG: "Backends written against 0.1 keep working").
Do not modernise this file.
"""

import ctypes
import threading

import kvcore


class DictConfig(kvcore.BackendConfig):
    env_prefix = "KVCORE_DICT01_"


class DictBackend:
    config_model = DictConfig
    capabilities = kvcore.Capabilities(addressing="key", io="host")

    def __init__(self, config, context):
        self.config = config
        self.objects = {}
        self.lock = threading.Lock()
        self.reads = 0

    @kvcore.hookimpl
    def kvcore_query(self, request):
        n = 0
        with self.lock:
            for names in request.object_names:
                if not all(name in self.objects for name in names):
                    break
                n += 1
        return n

    @kvcore.hookimpl
    def kvcore_read(self, request):
        done = 0
        for i, names in enumerate(request.object_names):
            if request.expired():
                break
            with self.lock:
                blobs = [self.objects.get(name) for name in names]
            if any(b is None or len(b) != request.host.nbytes[j] for j, b in enumerate(blobs)):
                break
            for j, blob in enumerate(blobs):
                ctypes.memmove(request.host.ptrs[i][j], blob, len(blob))
            done += 1
        self.reads += done
        return done

    @kvcore.hookimpl
    def kvcore_write(self, request):
        done = 0
        for i, names in enumerate(request.object_names):
            if request.expired():
                break
            blobs = [
                ctypes.string_at(request.host.ptrs[i][j], request.host.nbytes[j])
                for j in range(len(names))
            ]
            with self.lock:
                for name, blob in zip(names, blobs, strict=True):
                    self.objects[name] = blob
            done += 1
        return done

    @kvcore.hookimpl
    def kvcore_stats(self):
        return {"objects": float(len(self.objects)), "blocks_read": float(self.reads)}

    @kvcore.hookimpl
    def kvcore_close(self):
        self.objects.clear()
