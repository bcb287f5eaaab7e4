"""A video+image model fed through a storage node that decodes next to the data (pushdown).

A captioned folder of H.264 clips and JPEGs is packed into the node's data root, with a plan beside it. One
``foresight node serve`` process (a single node needs no etcd) reads and decodes the coming steps ahead of the job
with the same ``MediaDecodeStage`` code the host would run; the job's loader gets the tensors through a
``NodeSource``. A second node runs with its CPU guard always engaged (``--cpu-threshold 0``): it returns raw bytes
and the host decodes them. The example trains a small model on each feed and checks that host decode, pushdown and
the guard's raw fallback give the same tensors (``output_hash``) and the same losses.

Run it::

    python examples/media_node_pushdown.py --out /tmp/media
    # a cluster: etcd + `foresight node serve --root R --etcd http://127.0.0.1:2379` per node, then
    # NodeSource(stage, plan, etcd="http://127.0.0.1:2379", token=...) (see python/foresight/node/client.py)

While it runs, ``foresight node status --node LOCATION`` (from ``OUT/pushdown.ready.json``) prints the job's queue,
lead and fallback rate; ``--metrics-port`` gives the same to Prometheus. ``--smoke`` is the small setting
tests/test_examples.py runs.
"""
import argparse, json, os, shutil, subprocess, sys, time

import torch

from foresight.format import open_dataset, pack_media
from foresight.loader import Loader, MediaDecodeStage
from foresight.media import FrameSampling, TransformSpec, output_hash
from foresight.testing.media_synth import make_image, make_video
from foresight.node import NodeSource
from foresight.plan import build_plan

SPECS = {"image": TransformSpec(modality="image", size=(32, 32), crop="random_resized", flip=0.5),
         "video": TransformSpec(modality="video", size=(32, 32), frames=FrameSampling(num_frames=4, window_s=1.0))}
TOKEN = "example-job-token"


def make_root(root: str, clips: int, images: int, steps: int):
    src = f"{root}/src"
    os.makedirs(src, exist_ok=True)
    with open(f"{root}/captions.jsonl", "w") as f:
        for i in range(clips):
            make_video(f"{src}/clip{i}.mp4", seconds=2, width=96, height=64, gop=15)
            f.write(json.dumps({"file": f"clip{i}.mp4", "caption": f"a test pattern, take {i}"}) + "\n")
        for i in range(images):
            with open(f"{src}/image{i}.jpg", "wb") as img:
                img.write(make_image(width=80, height=60, seed=i))
            f.write(json.dumps({"file": f"image{i}.jpg", "caption": f"noise number {i}"}) + "\n")
    data = open_dataset(pack_media(src, f"{root}/media", captions=f"{root}/captions.jsonl", overwrite=True,
                                   progress=False))
    plan = build_plan([(data, 1.0)], seed=1, global_batch_size=4, num_steps=steps)
    plan.save(f"{root}/plans/run1")  # on the node's root: the node reads it there (or takes an upload, by digest)
    return data, plan


def start_node(out: str, name: str, cpu_threshold: int) -> tuple[subprocess.Popen, str]:
    ready = f"{out}/{name}.ready.json"  # the node writes its location here once it serves
    proc = subprocess.Popen([sys.executable, "-m", "foresight", "node", "serve", "--root", f"{out}/root",
                             "--ready-file", ready, "--cpu-threshold", str(cpu_threshold), "--decode-threads", "2"],
                            stderr=open(f"{out}/{name}.log", "w"))  # JSON log lines
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise SystemExit(f"node {name} exited with {proc.returncode}")
        time.sleep(0.1)
    return proc, json.load(open(ready))["location"]


def train(data, plan, node: str | None) -> tuple[list[str], list[float], dict]:
    """One pass of a tiny video+image model; returns the batches' hashes, the losses and where samples decoded."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3 * 32 * 32, 2)  # tells images from (time-averaged) video frames
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stage = MediaDecodeStage([data], SPECS, seed=7, threads=2)
    source = NodeSource(stage, plan, nodes=[node], token=TOKEN, job="media-run") if node else None
    hashes, losses = [], []
    with Loader(plan, datasets=data, decode=stage, source=source, meta_fields=("caption",)) as loader:
        for batch in loader:
            # (N, 3, 32, 32) images and (N, T, 3, 32, 32) clips averaged over time, as one batch of rows
            image = batch.get("image", torch.zeros(0, 3, 32, 32))  # a step may hold only one modality
            video = batch.get("video", torch.zeros(0, 1, 3, 32, 32))
            rows = torch.cat([image.float(), video.float().mean(1)]).flatten(1) / 255
            labels = torch.cat([torch.zeros(len(image)), torch.ones(len(video))]).long()
            loss = torch.nn.functional.cross_entropy(model(rows), labels)
            opt.zero_grad(), loss.backward(), opt.step()
            hashes.append(" ".join(output_hash(batch[m]) for m in SPECS if m in batch))
            losses.append(loss.item())
            if node is None and batch.step == 0:
                print(f"step 0 videos {tuple(batch['video'].shape)}, captions {batch['video_caption']}")
    where = source.stats if node else {"host": "decoded everything"}
    if node:
        source.close()
    stage.close()
    return hashes, losses, where


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    steps, clips, images = (3, 3, 6) if args.smoke else (args.steps, 8, 24)
    out = os.path.abspath(args.out)
    shutil.rmtree(f"{out}/root", ignore_errors=True)  # an earlier run's: rebuilt
    for name in ("pushdown", "guarded"):
        if os.path.exists(f"{out}/{name}.ready.json"):
            os.unlink(f"{out}/{name}.ready.json")  # a stale location
    data, plan = make_root(f"{out}/root", clips, images, steps)
    nodes = [start_node(out, "pushdown", 101), start_node(out, "guarded", 0)]  # 101%: the guard never engages
    try:
        host = train(data, plan, None)
        pushed = train(data, plan, nodes[0][1])
        raw = train(data, plan, nodes[1][1])
    finally:
        for proc, _ in nodes:
            proc.terminate(), proc.wait(60)
    for name, (_, losses, where) in (("host decode", host), ("pushdown", pushed), ("guard -> raw", raw)):
        keep = {k: v for k, v in where.items() if k.startswith("samples_") or k == "host"}
        print(f"{name:>13}: losses {[round(x, 4) for x in losses]}  {keep}")
    same = host[:2] == pushed[:2] == raw[:2] and len(host[1]) > 0  # a comparison of nothing proves nothing
    print(f"host decode, pushdown and the guard's raw fallback give the same tensors and losses: {same} "
          f"({len(host[1])} steps compared three ways)")
    return 0 if same and pushed[2]["samples_remote"] > 0 and raw[2]["samples_raw"] > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
