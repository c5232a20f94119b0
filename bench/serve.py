"""The search service (`dmltrain serve`): time from start to its first answer, and request latency.

Builds the bundled glyph set (or uses ``--data-root``), a quickstart-shaped model with seeded random
weights (the network's cost does not depend on its training), and a flat index of the test split with
`dmltrain index`'s code; then starts `dmltrain serve` as a user does, waits for ``/ping`` and posts
requests of 1 and ``--batch`` base64 images (k=10) from this process, a warm-up and then ``--repeat`` each.
Each answer is checked against the in-process search of the same images.

    python bench/serve.py            # glyphs, resnet18 at 32 px, 32-d, 20 requests per size
    python bench/serve.py --quick    # 5 requests per size
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(port: int, images: list[str], k: int) -> tuple[float, list[dict]]:
    body = {"dataframe_split": {"columns": ["image"], "data": [[x] for x in images]}, "params": {"k": k}}
    url = f"http://127.0.0.1:{port}/invocations"
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        out = json.loads(response.read())["predictions"]
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="5 requests per size")
    parser.add_argument("--data-root", default=None, help="prepared data (default: build the glyph set)")
    parser.add_argument("--batch", type=int, default=32, help="images in the larger request")
    parser.add_argument("--repeat", type=int, default=None, help="requests per size (default 20; quick 5)")
    args = parser.parse_args()
    repeat = args.repeat or (5 if args.quick else 20)

    import torch

    from dmltrain.data import ensure_glyphs, load_dataset_info
    from dmltrain.data.shards import read_shard
    from dmltrain.index import load_index
    from dmltrain.service.builders import build_network
    from dmltrain.service.config import load_config
    from dmltrain.service.serving.indexing import build_split_index, search_images
    from dmltrain.service.serving.weights import save_weights

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        root = Path(args.data_root) if args.data_root else ensure_glyphs(work / "glyphs")
        config = load_config(
            REPO / "configs" / "quickstart.yaml",
            [f"data.root={root}", "data.prepare=null", "model.embedding_dim=32"],
        )
        torch.manual_seed(0)
        weights = save_weights(
            work / "model.pt", build_network(config).state_dict(), config.model_dump(mode="json"), 0
        )
        index_dir, meta = build_split_index(str(weights), str(root), out=work / "index", log_to_run=False)
        info = load_dataset_info(root)
        queries = []
        for sample in read_shard(info.shard_urls(root, meta["split"])[0], shard=0):
            queries.append(work / f"q{len(queries)}.img")
            queries[-1].write_bytes(sample.data)
            if len(queries) == args.batch:
                break
        expected, _model = search_images(load_index(index_dir), queries, 10)
        images = [base64.b64encode(q.read_bytes()).decode() for q in queries]

        port = _free_port()
        command = [sys.executable, "-m", "dmltrain.service.cli", "serve", str(index_dir), "--port", str(port)]
        started = time.monotonic()
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"dmltrain serve exited with {server.returncode}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                        break
                except (urllib.error.URLError, ConnectionError):
                    time.sleep(0.1)
            ready = time.monotonic() - started
            print(
                f"index: {meta['ntotal']} images of {meta['dataset']}/{meta['split']}, "
                f"{meta['description']}, dim 32; torch threads {torch.get_num_threads()}"
            )
            print(f"dmltrain serve: first /ping answered {ready:.1f} s after the start")
            for size in (1, len(images)):
                _post(port, images[:size], 10)  # warm-up
                times = []
                for _ in range(repeat):
                    seconds, rows = _post(port, images[:size], 10)
                    times.append(seconds)
                    got = [(r["query"], r["key"]) for r in rows]
                    want = [(q, hit["key"]) for q, e in enumerate(expected[:size]) for hit in e.neighbours]
                    assert got == want, "the service's neighbours differ from the in-process search"
                times.sort()
                print(
                    f"{size:>3} image(s) a request, k=10: median {statistics.median(times) * 1e3:.1f} ms, "
                    f"slowest {times[-1] * 1e3:.1f} ms ({repeat} requests; "
                    f"{size / statistics.median(times):.0f} images/s)"
                )
        finally:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
