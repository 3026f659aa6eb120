"""Listing a Mooncake cluster of many keys, and following it (issue 62 #3).

A real ``mooncake_master`` on 127.0.0.1 holds ``--keys`` objects of another namespace (16
bytes each) and a few of this one. Per repetition:

- ``raw_listing_s``: the master's ``GET /get_all_keys`` read whole with no bound, in this
  process: the limit any listing of the cluster meets;
- ``names_s``: kvcore's ``Backend.names()`` (the listing, parsed, the namespace's names), with
  the default ``connect_timeout_s`` (2 s); ``old_bound_failed``: whether the listing fails
  when bounded by the connect timeout alone, as before the fix (1: it does);
- ``watch_report_s``: a peer writes a block while this client follows the store: seconds
  until the stream reports it, against the watch's interval (stretched to five listings) plus
  one listing (``watch_report_vs_interval_plus_listing``, goal <= 1);
- ``listing_rss_mb``: how much the process's peak RSS grew over the first listing.

    python benchmarks/bench_mooncake_listing.py --keys 1000000 --reps 3 [--json]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from benchutil import Report, emit
from kv_mooncake.connect import http_get
from kv_mooncake.testing import MooncakeCluster
from kv_mooncake.watch import LISTING_SHARE

import kvcore
from kvcore.testing import Harness, small_layout


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fill(client: object, keys: int) -> float:
    """``keys`` tiny objects of namespace ``crowd``; the seconds it took."""
    t0 = time.perf_counter()
    for lo in range(0, keys, 1000):
        batch = [f"crowd/{i}" for i in range(lo, min(keys, lo + 1000))]
        code = client.put_batch(batch, [b"v" * 16] * len(batch))  # type: ignore[attr-defined]
        if code != 0:
            raise RuntimeError(f"put_batch at key {lo} failed with {code}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000, help="keys of another namespace")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--connect-timeout", type=float, default=2.0)
    ap.add_argument("--watch-interval", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = Report()
    layout = small_layout()
    storage = max(256 << 20, args.keys * 256)
    with MooncakeCluster(storage_bytes=storage) as cluster:
        config = cluster.config(
            connect_timeout_s=args.connect_timeout, watch_interval_s=args.watch_interval
        )
        mine = kvcore.open_backend("mooncake", config, context={"layout": layout})
        peer = kvcore.open_backend("mooncake", config, context={"layout": layout})
        crowd = kvcore.open_backend("mooncake", config, context={"namespace": "crowd"})
        try:
            report.notes["fill_s"] = round(fill(crowd.plugin._store, args.keys), 1)
            listing = mine.plugin._listing
            h, p = Harness(mine, layout), Harness(peer, layout)
            seq = h.new_sequence(2)
            assert h.write(seq) == 2
            ours = {n for row in h.request(seq).object_names for n in row}
            raw, names, old, report_s, bound, rss = [], [], [], [], [], []
            for rep in range(args.reps):
                t0 = time.perf_counter()
                body = http_get(listing.url, 3600.0)
                raw.append(time.perf_counter() - t0)
                del body
                before = peak_rss_mb()
                t0 = time.perf_counter()
                listed = set(mine.names())
                names.append(time.perf_counter() - t0)
                rss.append(peak_rss_mb() - before)
                assert ours <= listed, "this namespace's blocks are missing from the listing"
                try:
                    http_get(listing.url, args.connect_timeout)
                    old.append(0.0)
                except OSError:
                    old.append(1.0)
                with mine.events.subscribe() as sub:
                    time.sleep(args.watch_interval)  # the watch's first rounds
                    block = p.new_sequence(1)
                    wanted = {n for row in p.request(block).object_names for n in row}
                    t0 = time.perf_counter()
                    assert p.write(block) == 1
                    seen: set[str] = set()
                    while not wanted <= seen and time.perf_counter() - t0 < 600:
                        for event in sub.drain():
                            if event.kind == "stored":
                                seen.update(event.names)
                        time.sleep(0.01)
                    report_s.append(time.perf_counter() - t0)
                    interval = max(args.watch_interval, LISTING_SHARE * names[-1])
                    bound.append(interval + names[-1])
                print(f"rep {rep}: listing {names[-1]:.2f} s, watch {report_s[-1]:.2f} s",
                      file=sys.stderr)  # fmt: skip
            report.figure("raw_listing_s", raw, "s")
            report.figure("names_s", names, "s")
            report.figure("old_bound_failed", old, "1: failed")
            report.figure("watch_report_s", report_s, "s")
            report.figure("listing_rss_mb", rss, "MB")
            report.ratio("names_vs_raw_listing", names, raw, goal="<= 3")
            report.ratio("watch_report_vs_interval_plus_listing", report_s, bound, goal="<= 1")
            report.notes["keys"] = args.keys
            report.notes["connect_timeout_s"] = args.connect_timeout
            h.release()
            p.release()
        finally:
            mine.close()
            peer.close()
            crowd.close()
    emit(report.as_dict(), args.json)


if __name__ == "__main__":
    main()
