#!/usr/bin/env python3
"""Writes a copy of the FlashInfer peer benchmark whose ranks may share GPUs.

The peer benchmark (`run_peer_bench.py`, kept outside this repository)
puts rank r on GPU r and bootstraps torch.distributed over NCCL, so it
needs a GPU per rank. On a one-GPU machine this copy puts rank r on GPU
r % device_count and, when ranks share a GPU, bootstraps over gloo (NCCL
refuses two ranks on one GPU). Only the FlashInfer backends (`fi_seed`,
`fi_best`) run that way: they exchange CUDA IPC handles through
`all_gather_object`, which gloo carries. Run the processes under MPS
(docs/RESULTS.md: without it two contexts on one GPU time-slice).

Nothing of FlashInfer's kernels or host code is changed: only the
harness's device choice, process-group backend and warm-up collective.

    python3 benches/gpu/peer-shared-gpu.py SRC_DIR DEST_DIR
"""
import shutil
import sys

EDITS = [
    # (old, new): each must occur exactly once in run_peer_bench.py.
    (
        "    if ndev < world:\n",
        "    if ndev < world and not _SHARED_GPUS:\n",
    ),
    (
        "        torch.cuda.set_device(rank)\n        dev = torch.device(\"cuda\", rank)\n",
        "        shared = _SHARED_GPUS and torch.cuda.device_count() < world\n"
        "        torch.cuda.set_device(rank % torch.cuda.device_count())\n"
        "        dev = torch.device(\"cuda\", rank % torch.cuda.device_count())\n",
    ),
    (
        "        kw = dict(backend=\"nccl\",",
        "        kw = dict(backend=\"gloo\" if shared else \"nccl\",",
    ),
    (
        "            dist.init_process_group(device_id=dev, **kw)\n",
        "            if shared:\n"
        "                dist.init_process_group(**kw)\n"
        "            else:\n"
        "                dist.init_process_group(device_id=dev, **kw)\n",
    ),
    (
        "        t = torch.ones(1024, device=dev)\n",
        "        t = torch.ones(1024, device=\"cpu\" if shared else dev)\n",
    ),
]

HEADER = (
    "# Patched by tp-allreduce's benches/gpu/peer-shared-gpu.py: ranks may share GPUs\n"
    "# (TP_PEER_SHARED_GPUS=1; gloo bootstrap, FlashInfer backends only).\n"
    "_SHARED_GPUS = __import__(\"os\").environ.get(\"TP_PEER_SHARED_GPUS\") == \"1\"\n"
)


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, dest = sys.argv[1], sys.argv[2]
    shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    path = f"{dest}/run_peer_bench.py"
    with open(f"{src}/run_peer_bench.py") as f:
        text = f.read()
    for old, new in EDITS:
        n = text.count(old)
        if n != 1:
            print(f"peer-shared-gpu: expected one occurrence, found {n}: {old!r}", file=sys.stderr)
            return 1
        text = text.replace(old, new)
    # After the module docstring and the __future__ import (if any).
    marker = "\nimport argparse\n"
    if text.count(marker) != 1:
        print("peer-shared-gpu: `import argparse` not found once", file=sys.stderr)
        return 1
    text = text.replace(marker, "\n" + HEADER + marker)
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
