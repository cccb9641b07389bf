"""Regenerate the console screenshots in this directory from a demo setup.

    .venv/bin/python screenshots/generate.py        # or: just screenshots

Starts what ``scry demo`` starts (a throwaway PostgreSQL, scry in hybrid
mode, the synthetic e-commerce workload), lets it run a few seconds, renders
every console view headless with ``scry_tui`` (as ``scry screenshot`` does)
into ``screenshots/console-<view>.svg``, then removes everything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from scry.demo import _config
from scry.devcluster import DevCluster
from scry.proxy import Proxy
from scry.workload import WorkloadStats, load_schema, run_workload
from scry_tui.actions import VIEW_IDS
from scry_tui.launch import capture_views
from scry_tui.targets import Fleet, make_target

HERE = Path(__file__).resolve().parent


async def generate(out: Path, warmup: float, clients: int) -> list[Path]:
    cluster = DevCluster(ssl=False, prefix="scry-shots-")
    cluster.start()
    try:
        await load_schema(cluster.dsn())
        proxy = Proxy(_config(cluster, "hybrid", 0))
        await proxy.start()
        stop = asyncio.Event()
        dsn = f"postgresql://app:app_pass@127.0.0.1:{proxy.listen_port}/app"
        workload = asyncio.create_task(run_workload(dsn, clients, None, WorkloadStats(), stop))
        try:
            await asyncio.sleep(warmup)
            assert proxy.admin is not None
            target = make_target(
                f"http://{proxy.admin.address}", name="demo", token=proxy.config.admin.token
            )
            paths, reachable = await capture_views(
                Fleet(targets=[target]),
                out,
                list(VIEW_IDS),
                settle=2.0,
                name_template="console-{view}.svg",
            )
            if not reachable:
                raise SystemExit("the demo proxy's admin API did not answer")
            return paths
        finally:
            stop.set()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(workload, 10)
            proxy.stop_now()
            await asyncio.sleep(0)
    finally:
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--warmup", type=float, default=6.0, help="seconds of workload first")
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    for path in asyncio.run(generate(args.out, args.warmup, args.clients)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
