#!/usr/bin/env python3
"""A member that attracts traffic and drops it (issue 44, point 5), on the simulator.

The 11-city matrix on virtual time (pure MeshNodes, real signatures), one member
(``--liar``, Chicago by default) either honest or hostile: it publishes every link's RTT
at 1% of what it measured and forwards no copy of anyone else's chunk, repairs
included (tests/mesh/relayattack.py). Every honest origin broadcasts a 1 KiB chunk every
``--interval`` seconds: ``--learn`` seconds not counted, then ``--measure`` seconds whose
delivery lags (broadcast to each honest node's delivery) are counted. Printed per run:
the lags' p50 and p90, in how many honest origins' trees the member relays, honest
chunks never delivered, copies it dropped, its link claims not taken (summed over the
honest nodes) and honest relays an honest node stopped counting on (false alarms);
then ``relay_delivery_p90_over_clean``, the attacked p90 over the honest one.

    python bench/relaytrust.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the attacker is a test's

from tests.mesh.relayattack import LIAR, relay_run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--liar", default=LIAR)
    ap.add_argument("--seeds", default="5", help="comma-separated simulation seeds")
    ap.add_argument("--learn", type=float, default=20.0)
    ap.add_argument("--measure", type=float, default=20.0)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        row: dict[str, object] = {"seed": seed, "liar": args.liar}
        p90 = {}
        for attack in (False, True):
            started = time.perf_counter()
            run = relay_run(
                attack,
                liar=args.liar,
                seed=seed,
                learn_s=args.learn,
                measure_s=args.measure,
                interval_s=args.interval,
            )
            name = "attacked" if attack else "clean"
            row[name] = {**run.summary(), "wall_s": round(time.perf_counter() - started, 1)}
            p90[name] = run.p(0.9)
            print(name, seed, row[name], flush=True)
        row["relay_delivery_p90_over_clean"] = round(p90["attacked"] / p90["clean"], 3)
        print("relay_delivery_p90_over_clean", seed, row["relay_delivery_p90_over_clean"])
        rows.append(row)
    if args.json:
        print(json.dumps({"bench": "relaytrust", "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
