"""Video decode bench: "8 frames evenly over a 4 s window at a random start, resized to 224x224".

Side by side in one run, on H.264 clips (x264 defaults, B-frames) of 60 s at 720p and 360p with GOP 60
and GOP 250, generated once and cached (``--clips-dir``, default /tmp/foresight_bench_clips):

* ``foresight``     foresight.media via DecodePool (keyframe index, NONREF skip, drain, swscale resize)
* ``pyav_start``    PyAV decoding from the start of the clip, stopping after the last wanted frame
* ``pyav_seek``     PyAV seeking to the first wanted time without the index, then decoding forward
* ``decord``        decord VideoReader(width=224, height=224).get_batch
* ``tc_exact``      torchcodec VideoDecoder(seek_mode="exact", transforms=[Resize]).get_frames_at
* ``tc_approx``     the same with seek_mode="approximate"
* ``tc_mapped``     the same with the clip's frame index given up front (``custom_frame_mappings``, built from the
                    pack-time probe outside the timing, as foresight's own index is)

Every method gets the same frame indices per sample and decodes from the clip's bytes in memory with
one FFmpeg thread; "threads" is the number of samples decoded at once (a thread pool). Each method's
frames are checked against a reference decode from the start, by timestamp and by pixels, at native
resolution; and every frame of the timed 224x224 output (the last repeat's) is checked for identity against the
reference frames resized alike: it must be closer to the frame it names than to that frame's neighbours. A method
whose package is unavailable is listed as such in the tables, never silently dropped. torchcodec needs FFmpeg shared
libraries: we point it at the ones inside the running venv's PyAV wheel (symlinks with the plain sonames in a directory
of this run under TMPDIR, + LD_LIBRARY_PATH, set by re-executing this script; the directory goes when the run ends).

Usage::

    python bench/decode.py            # full run (~10 min on 2 cores, the first run also encodes the clips)
    python bench/decode.py --smoke    # seconds: tiny clips, one repeat
"""
from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
import glob
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import av
from common import RESULTS, machine, print_table, write_results
from foresight.media import (
    DecodePool,
    FrameSampling,
    TransformSpec,
    decode_video,
    probe_media,
    sample_frame_indices,
    video_pts,
)
from foresight.testing.media_reference import convert, iter_frames
from foresight.testing.media_synth import make_video

OUT = 224
METHODS = ("foresight", "pyav_start", "pyav_seek", "decord", "tc_exact", "tc_approx", "tc_mapped")
ANCHORS = METHODS[2:]  # what foresight is compared with (pyav_start is the naive baseline)
FULL = [  # (name, width, height, gop)
    ("360p_gop60", 640, 360, 60), ("360p_gop250", 640, 360, 250),
    ("720p_gop60", 1280, 720, 60), ("720p_gop250", 1280, 720, 250),
]
SMOKE = [("smoke_gop15", 160, 120, 15), ("smoke_gop60", 160, 120, 60)]


# ---------------------------------------------------------------- torchcodec: FFmpeg from the PyAV wheel
def _av_libs() -> str:
    return os.path.realpath(os.path.join(os.path.dirname(av.__file__), "..", "av.libs"))


TC_ENV = "FORESIGHT_BENCH_TC_ENV"  # set in the re-executed process: the run's FFmpeg link directory


def ffmpeg_links(links: Path) -> Path:
    """Symlinks under FFmpeg's plain sonames (``libavcodec.so.62``) to the running venv's PyAV copies, in ``links``.

    A link already there that names another file (another venv's FFmpeg, or nothing: a dangling link) is replaced
    atomically, so a stale directory can neither fail the run nor load the wrong libraries.

    Example::

        ffmpeg_links(Path(tempfile.mkdtemp()))  # then LD_LIBRARY_PATH=<that dir> for torchcodec
    """
    links.mkdir(parents=True, exist_ok=True)
    for path in sorted(glob.glob(os.path.join(_av_libs(), "lib*.so*"))):
        base = os.path.basename(path)  # libavcodec-5e6b81c2.so.62.28.102 -> libavcodec.so.62
        name, _, ver = base.partition(".so.")
        if not ver or not name.startswith(("libav", "libsw")):
            continue
        link = links / f"{name.split('-')[0]}.so.{ver.split('.')[0]}"
        if os.path.islink(link) and os.readlink(link) == path:
            continue
        tmp = links / f".{link.name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path)
        os.replace(tmp, link)
    return links


def _ensure_torchcodec_env() -> None:
    """Re-exec with LD_LIBRARY_PATH pointing at PyAV's FFmpeg under plain sonames, once. The links live in a
    directory of this run (under TMPDIR), removed when the re-executed bench exits."""
    if os.environ.get(TC_ENV):
        links = Path(os.environ[TC_ENV])
        if links.name.startswith("foresight-tc-ffmpeg-"):  # ours: made for this run just before the re-exec
            atexit.register(shutil.rmtree, links, ignore_errors=True)
        return
    links = ffmpeg_links(Path(tempfile.mkdtemp(prefix="foresight-tc-ffmpeg-")))
    env = dict(os.environ, **{TC_ENV: str(links)})
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(links), _av_libs(), env.get("LD_LIBRARY_PATH")) if p)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _optional_anchors() -> dict[str, str]:
    """Import decord and torchcodec; returns {package: version or why it is unavailable}."""
    found = {}
    try:
        import decord

        found["decord"] = decord.__version__
    except Exception as e:  # noqa: BLE001 - report any import failure
        found["decord"] = f"unavailable: {type(e).__name__}: {e}"
    try:
        import torchcodec
        from torchcodec.decoders import VideoDecoder  # noqa: F401

        found["torchcodec"] = torchcodec.__version__
    except Exception as e:  # noqa: BLE001
        found["torchcodec"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return found


# ---------------------------------------------------------------- clips
def ensure_clips(clips_dir: Path, configs, seconds: float) -> dict[str, Path]:
    clips_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, w, h, gop in configs:
        path = clips_dir / f"h264_{name}_{int(seconds)}s.mp4"
        if not path.exists():
            t0 = time.perf_counter()
            make_video(str(path), codec="libx264", width=w, height=h, seconds=seconds, fps=30, gop=gop)
            print(f"encoded {path} in {time.perf_counter() - t0:.1f} s", flush=True)
        out[name] = path
    return out


# ---------------------------------------------------------------- the methods (one sample each)
def _pyav_select(data: bytes, times: np.ndarray, size, seek: bool) -> np.ndarray:
    """Plain PyAV: frames shown at `times` (s), from the start or after one seek; stops after the last."""
    want = sorted(set(times.tolist()))
    got: dict[float, np.ndarray] = {}
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        s.codec_context.thread_count = 1
        s.codec_context.thread_type = "SLICE"
        half = 0.5 / float(s.average_rate)
        if seek:
            c.seek(int(want[0] / s.time_base), stream=s, backward=True)
        i = 0
        for frame in c.decode(s):
            t = frame.time
            while i < len(want) and t > want[i] + half:
                i += 1
            if i < len(want) and abs(t - want[i]) <= half:
                img = frame.to_ndarray(format="rgb24") if size is None else \
                    frame.reformat(size, size, "rgb24").to_ndarray()
                got[want[i]] = img
                i += 1
            if i >= len(want):
                break
    return np.stack([got[t] for t in times.tolist()])


def _decord(data: bytes, idx: np.ndarray, size) -> np.ndarray:
    import decord

    kw = {} if size is None else {"width": size, "height": size}
    vr = decord.VideoReader(io.BytesIO(data), num_threads=1, **kw)
    return vr.get_batch(idx.tolist()).asnumpy()


def _torchcodec(data: bytes, idx: np.ndarray, size, mode: str, mappings: str | None = None) -> np.ndarray:
    from torchcodec.decoders import VideoDecoder
    from torchcodec.transforms import Resize

    tf = None if size is None else [Resize(size=(size, size))]
    kw = {"custom_frame_mappings": mappings} if mappings else {"seek_mode": mode}
    d = VideoDecoder(data, num_ffmpeg_threads=1, dimension_order="NHWC", transforms=tf, **kw)
    return d.get_frames_at(idx.tolist()).data.numpy()


def frame_mappings(meta: dict) -> str:
    """torchcodec's custom_frame_mappings JSON from foresight's probe: pts, duration and key flag per frame."""
    import json

    pts = video_pts(meta).astype(np.int64)
    dur = np.diff(pts, append=pts[-1] + (pts[-1] - pts[-2] if len(pts) > 1 else 1))
    keys = set(int(k) for k in meta["key_frames"])
    return json.dumps({"frames": [{"pts": int(p), "duration": int(d), "key_frame": int(i in keys)}
                                  for i, (p, d) in enumerate(zip(pts.tolist(), dur.tolist()))]})


def method_fn(method: str, size):
    if method == "pyav_start":
        return lambda data, meta, idx, times: _pyav_select(data, times, size, seek=False)
    if method == "pyav_seek":
        return lambda data, meta, idx, times: _pyav_select(data, times, size, seek=True)
    if method == "decord":
        return lambda data, meta, idx, times: _decord(data, idx, size)
    if method in ("tc_exact", "tc_approx"):
        mode = "exact" if method == "tc_exact" else "approximate"
        return lambda data, meta, idx, times: _torchcodec(data, idx, size, mode)
    if method == "tc_mapped":
        return lambda data, meta, idx, times: _torchcodec(data, idx, size, "exact", meta["_tc_mappings"])
    raise ValueError(method)


# ---------------------------------------------------------------- correctness
def reference_frames(data: bytes, pts_needed: set[int], pts_small: set[int] = frozenset()):
    """The reference (``foresight.testing.media_reference``: every frame from the start with PyAV's own API, no code of
    foresight's decoder or converter): native frames whose pts is in ``pts_needed`` and OUT x OUT (bilinear)
    ones whose pts is in ``pts_small``."""
    out, small = {}, {}
    for pts, frame in iter_frames(data, threads=2):
        if pts in pts_needed and pts not in out:
            out[pts] = convert(frame)
        if pts in pts_small and pts not in small:
            small[pts] = convert(frame, size=(OUT, OUT), interpolation="BILINEAR")
        if len(out) == len(pts_needed) and len(small) == len(pts_small):
            break
    return out, small


def verify_timed(outputs: list[np.ndarray], samples, pts_all: np.ndarray, ref_small: dict[int, np.ndarray]) -> dict:
    """Every timed 224x224 frame: identity (closer to the reference frame it names than to its neighbours) and
    pixels against that frame (foresight must be exact: the same swscale call; other resizers differ)."""
    wrong = total = exact = max_diff = 0
    diffs = []
    for frames, idx in zip(outputs, samples):
        frames = np.asarray(frames)
        for k, i in enumerate(idx):
            got = frames[k].astype(np.int16)
            errs = {j: np.abs(got - ref_small[int(pts_all[j])]).mean()
                    for j in range(max(0, i - 2), min(len(pts_all), i + 3)) if int(pts_all[j]) in ref_small}
            total += 1
            wrong += int(min(errs, key=errs.get) != i)
            diffs.append(errs[i])
            diff = int(np.abs(got - ref_small[int(pts_all[i])]).max())
            exact += int(diff == 0)
            max_diff = max(max_diff, diff)
    return {"frames_224": total, "wrong_frame_224": wrong, "pixel_exact_224": exact, "max_abs_diff_224": max_diff,
            "mean_abs_diff_224": float(np.mean(diffs))}


def verify(method: str, data: bytes, meta: dict, samples: list[np.ndarray], spec_frames, pts_all: np.ndarray,
           ref: dict[int, np.ndarray]) -> dict:
    """Native-resolution frames of `method` vs the reference, by timestamp (identity) and pixels."""
    exact = wrong = total = 0
    max_diff = 0
    for sid, idx in enumerate(samples):
        times = idx * (1.0 / float(Fraction(*meta["avg_rate"])))
        if method == "foresight":
            frames = decode_video(data, meta, spec_frames, seed=SEED, sample_id=sid)
        else:
            frames = method_fn(method, None)(data, meta, idx, times)
        frames = np.asarray(frames)
        for k, i in enumerate(idx):
            total += 1
            want = ref[int(pts_all[i])].astype(np.int16)
            diff = np.abs(frames[k].astype(np.int16) - want)
            max_diff = max(max_diff, int(diff.max()))
            exact += int(not diff.any())
            # identity: the expected frame must match better than its neighbours
            errs = {j: np.abs(frames[k].astype(np.int16) - ref[int(pts_all[j])]).mean()
                    for j in range(max(0, i - 2), min(len(pts_all), i + 3)) if int(pts_all[j]) in ref}
            wrong += int(min(errs, key=errs.get) != i)
    return {"frames": total, "pixel_exact": exact, "wrong_frame": wrong, "max_abs_diff": max_diff}


# ---------------------------------------------------------------- timing
SEED = 20260601


def _cpu() -> float:
    return time.process_time()  # all threads of this process, ns resolution


def run_method(method: str, data: bytes, meta: dict, samples, threads: int, spec: TransformSpec,
               codec_threads: int = 1, keep: list | None = None) -> tuple[float, float]:
    """Decode all samples with `threads` at once; returns (wall seconds, process CPU seconds). The outputs go to
    ``keep`` (if given) after the clock stops, for the identity check of the timed frames."""
    n = len(samples)
    if method == "foresight":
        with DecodePool(threads=threads, codec_threads=codec_threads) as pool:
            t0, c0 = time.perf_counter(), _cpu()
            out = pool.decode(spec, [data] * n, [meta] * n, list(range(n)), seed=SEED, epoch=0)
            wall, cpu = time.perf_counter() - t0, _cpu() - c0
    else:
        fn = method_fn(method, OUT)
        rate = float(Fraction(*meta["avg_rate"]))
        with cf.ThreadPoolExecutor(threads) as ex:
            t0, c0 = time.perf_counter(), _cpu()
            out = list(ex.map(lambda idx: fn(data, meta, idx, idx / rate), samples))
            wall, cpu = time.perf_counter() - t0, _cpu() - c0
    if keep is not None:
        keep[:] = list(out)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny clips, one repeat: a few seconds")
    ap.add_argument("--samples", type=int, default=None, help="samples (clip windows) per timed run (>= 32)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per cell, median reported (>= 3)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--scaling", default="1,2,3,4", help="foresight pool sizes for the scaling sweep ('' = skip)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--only", default="", help="comma-separated clip names to run (default: all)")
    ap.add_argument("--clips-dir", default="/tmp/foresight_bench_clips")
    ap.add_argument("--no-torchcodec-env", action="store_true", help="do not re-exec for torchcodec's FFmpeg")
    args = ap.parse_args()
    if not args.no_torchcodec_env:
        _ensure_torchcodec_env()
    smoke = args.smoke
    configs = SMOKE if smoke else FULL
    if args.only:
        configs = [c for c in configs if c[0] in args.only.split(",")]
    seconds = 6.0 if smoke else 60.0
    n_samples = args.samples or (4 if smoke else 32)
    repeats = args.repeats or (1 if smoke else 3)
    thread_counts = [int(t) for t in args.threads.split(",")]
    scaling = [] if smoke or not args.scaling else [int(t) for t in args.scaling.split(",")]
    anchors = _optional_anchors()
    methods = [m for m in args.methods.split(",") if m]
    skipped = {}
    for m in list(methods):
        pkg = "decord" if m == "decord" else "torchcodec" if m.startswith("tc_") else None
        if pkg and anchors[pkg].startswith("unavailable"):
            methods.remove(m)
            skipped[m] = anchors[pkg]
    print(f"machine: {machine()}\nanchors: {anchors}", flush=True)
    clips = ensure_clips(Path(args.clips_dir), configs, seconds)
    frames_spec = FrameSampling(num_frames=8, window_s=4.0)
    spec = TransformSpec(modality="video", frames=frames_spec, size=(OUT, OUT), layout="channels_last",
                         output="numpy")
    rows, checks, sweep = [], [], []
    for name, *_ in configs:
        data = clips[name].read_bytes()
        meta = probe_media(data, "video")
        meta["_tc_mappings"] = frame_mappings(meta)  # torchcodec's index, like foresight's, built before timing
        samples = [sample_frame_indices(meta, frames_spec, seed=SEED, sample_id=i) for i in range(n_samples)]
        pts_all = video_pts(meta)
        n_check = min(2 if not smoke else n_samples, n_samples)
        needed = {int(pts_all[j]) for idx in samples[:n_check] for i in idx
                  for j in range(max(0, i - 2), min(len(pts_all), i + 3))}
        small_needed = {int(pts_all[j]) for idx in samples for i in idx
                        for j in range(max(0, i - 2), min(len(pts_all), i + 3))}
        ref, ref_small = reference_frames(data, needed, small_needed)
        for m in methods:
            v = verify(m, data, meta, samples[:n_check], frames_spec, pts_all, ref)
            checks.append({"clip": name, "method": m, **v})
        for m in methods:
            run_method(m, data, meta, samples[:1], 1, spec)  # warm-up (imports, caches)
        # round-robin over (method, threads) in every repeat, so load from elsewhere hits all cells alike
        cells = [(m, t) for m in methods for t in thread_counts]
        timings: dict[tuple, list] = {c: [] for c in cells}
        outputs: dict[tuple, list] = {c: [] for c in cells}
        for _ in range(repeats):
            for m, t in cells:
                timings[(m, t)].append(run_method(m, data, meta, samples, t, spec, keep=outputs[(m, t)]))
        for c in checks:
            if c["clip"] == name:
                c.update(verify_timed(outputs[(c["method"], thread_counts[0])], samples, pts_all, ref_small))
        del outputs
        for m, t in cells:
            runs = timings[(m, t)]
            med = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            rows.append({"clip": name, "method": m, "threads": t, "clips_per_s": n_samples / med,
                         "cpu_ms_per_clip": 1000 * cpu / n_samples,
                         "runs_s": [round(w, 4) for w, _ in runs]})
            print(f"{name:12s} {m:10s} threads={t} {n_samples / med:8.2f} clips/s "
                  f"{1000 * cpu / n_samples:8.1f} cpu-ms/clip  load={os.getloadavg()[0]:.1f}", flush=True)
        for t, ct in [(t, 1) for t in scaling] + ([(1, 2)] if scaling else []):
            runs = [run_method("foresight", data, meta, samples, t, spec, ct) for _ in range(repeats)]
            sweep.append({"clip": name, "threads": t, "codec_threads": ct,
                          "clips_per_s": n_samples / statistics.median(w for w, _ in runs),
                          "cpu_ms_per_clip": 1000 * statistics.median(c for _, c in runs) / n_samples})
    summary = summarize(rows, thread_counts)
    cpu_rows = summarize_cpu(rows)
    print()
    print_table(checks, ["clip", "method", "frames", "pixel_exact", "wrong_frame", "max_abs_diff", "frames_224",
                         "wrong_frame_224", "pixel_exact_224", "max_abs_diff_224", "mean_abs_diff_224"],
                "correctness vs a reference decode from the start: native resolution, and every timed 224x224 frame")
    for row in summary:  # an anchor that could not run is shown as such, not left out
        row.update({m: "unavailable" for m in skipped})
    for row in cpu_rows:
        row.update({m: "unavailable" for m in skipped})
    print()
    print_table(summary, ["clip", "threads", *methods, *skipped, "vs_start", "vs_best_anchor", "best_anchor",
                          "scale_1_to_2"], "clips/s (median); ratios are foresight / other")
    print()
    print_table(cpu_rows, ["clip", *methods, *skipped, "cpu_vs_start", "cpu_vs_best_anchor", "best_anchor"],
                "CPU ms per clip at 1 thread (robust to other load on the machine); ratios other / foresight")
    if sweep:
        print()
        print_table(sweep, ["clip", "threads", "codec_threads", "clips_per_s", "cpu_ms_per_clip"], "foresight pool size sweep")
    if skipped:
        print(f"\nskipped: {skipped}")
    payload = {"bench": "decode", "smoke": smoke, "machine": machine(), "anchors": anchors, "skipped": skipped,
               "task": "8 frames evenly over a 4 s window at a random start, resized to 224x224",
               "samples_per_run": n_samples, "repeats": repeats, "rows": rows, "summary": summary, "cpu_summary": cpu_rows,
               "load_average": os.getloadavg(), "ffmpeg_links": os.environ.get(TC_ENV),
               "correctness": checks, "scaling": sweep}
    name = "decode_smoke" if smoke else "decode"
    path = write_results(name, payload)
    png = plot(summary, methods, RESULTS / f"{name}.png")
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))


def summarize(rows: list[dict], thread_counts: list[int]) -> list[dict]:
    table: dict[tuple, dict] = {}
    for r in rows:
        table.setdefault((r["clip"], r["threads"]), {"clip": r["clip"], "threads": r["threads"]})[r["method"]] = \
            r["clips_per_s"]
    out = list(table.values())
    for row in out:
        fs = row.get("foresight")
        if fs is None:
            continue
        if row.get("pyav_start"):
            row["vs_start"] = fs / row["pyav_start"]
        anchors = {m: row[m] for m in ANCHORS if isinstance(row.get(m), float)}
        if anchors:
            best = max(anchors, key=anchors.get)
            row["best_anchor"] = best
            row["vs_best_anchor"] = fs / anchors[best]
        one = table.get((row["clip"], 1), {}).get("foresight")
        if row["threads"] == 2 and one:
            row["scale_1_to_2"] = fs / one
    return out


def summarize_cpu(rows: list[dict]) -> list[dict]:
    table: dict[str, dict] = {}
    for r in rows:
        if r["threads"] == 1:
            table.setdefault(r["clip"], {"clip": r["clip"]})[r["method"]] = r["cpu_ms_per_clip"]
    for row in table.values():
        fs = row.get("foresight")
        if not fs:
            continue
        if row.get("pyav_start"):
            row["cpu_vs_start"] = row["pyav_start"] / fs
        anchors = {m: row[m] for m in ANCHORS if isinstance(row.get(m), float)}
        if anchors:
            best = min(anchors, key=anchors.get)
            row["best_anchor"], row["cpu_vs_best_anchor"] = best, anchors[best] / fs
    return list(table.values())


def plot(summary: list[dict], methods: list[str], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = [f"{r['clip']}\n{r['threads']} thr" for r in summary]
    width = 0.8 / max(1, len(methods))
    for k, m in enumerate(methods):
        ax.bar(np.arange(len(summary)) + k * width, [r.get(m) or 0 for r in summary], width, label=m)
    ax.set_xticks(np.arange(len(summary)) + 0.4 - width / 2, labels, fontsize=8)
    ax.set_ylabel("clips/s (8 frames, 224x224)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Frame-selective decode, 60 s H.264 clips (higher is better)")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
