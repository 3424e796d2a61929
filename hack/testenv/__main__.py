"""`python hack/testenv build|build-images|images|up|down|env` — see hack/testenv.sh for usage."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testenv import build, cluster, dockerfiles, images  # noqa: E402

# A test session (`make test`, `make chaos`) holds the environment while it runs; `up` or
# `down` from the command line would pull it from under the session's feet.
CLI_LOCK_TIMEOUT_S = 10.0


def main() -> int:
    p = argparse.ArgumentParser(prog="hack/testenv.sh", description="local Kubernetes control plane for tests")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build the binaries and the operator image into the cache (slow once)")
    sub.add_parser("build-images", help="write the pause, CoreDNS, operator and test trainer images as OCI archives")
    i = sub.add_parser("images", help="build images/*.Dockerfile (buildah, offline), check them, print their figures")
    i.add_argument("names", nargs="*", default=list(dockerfiles.DOCKERFILES), choices=list(dockerfiles.DOCKERFILES))
    u = sub.add_parser("up", help="start everything (idempotent); prints export lines for eval")
    u.add_argument("--nodes", type=int, default=4, help="kwok nodes (default 4)")
    u.add_argument("--real-nodes", type=int, default=0,
                   help="real nodes (kubelet + containerd, each in its own network namespace; default 0)")
    sub.add_parser("down", help="stop everything `up` started and remove its state")
    sub.add_parser("env", help="print the export lines of the running environment")
    args = p.parse_args()
    try:
        if args.cmd == "build":
            build.build()
            print(report(dockerfiles.build_image("operator")), file=sys.stderr)
        elif args.cmd == "images":
            t0 = time.monotonic()
            records = {name: dockerfiles.build_image(name) for name in args.names}
            for record in records.values():
                print(report(record))
            print(f"# images ready in {time.monotonic() - t0:.1f}s")
            print(json.dumps({"images": records}))
        elif args.cmd == "build-images":
            for ref, archive in images.build_images().items():
                print(f"{ref}\t{archive}")
        elif args.cmd == "up":
            t0 = time.monotonic()
            with cluster.session_lock(CLI_LOCK_TIMEOUT_S):  # never under a running test session
                env = cluster.up(args.nodes, args.real_nodes)
            print(env.exports())
            print(f"# control plane {env.version} up in {time.monotonic() - t0:.1f}s; "
                  f"nodes {', '.join(env.real_nodes + env.nodes)}")
        elif args.cmd == "down":
            with cluster.session_lock(CLI_LOCK_TIMEOUT_S):
                cluster.down()
        else:
            running = cluster.current()
            if running is None:
                print("no control plane is running: hack/testenv.sh up", file=sys.stderr)
                return 1
            print(running.exports())
    except dockerfiles.ImageBuildError as e:
        print(f"hack/testenv.sh {args.cmd}: {e}", file=sys.stderr)
        return 1
    except build.MissingTool as e:
        print(f"hack/testenv.sh {args.cmd}: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if "another test session" not in str(e):
            raise
        print(f"hack/testenv.sh {args.cmd}: {e}", file=sys.stderr)
        return 3
    return 0


def report(record: dict) -> str:
    """One line per image: what an admin reads first."""
    return (f"{record['image']}: id {record['id'].removeprefix('sha256:')[:12]}, {record['size_bytes'] / 1e6:.0f} MB "
            f"(archive {record['archive_bytes'] / 1e6:.0f} MB), user {record['user']}, "
            f"{record['python_packages']} Python and {record['debian_packages']} Debian packages, "
            + (f"built in {record['build_s']:.1f}s" if record["rebuilt"] else "inputs unchanged, not rebuilt"))


if __name__ == "__main__":
    raise SystemExit(main())
