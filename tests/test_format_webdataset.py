"""``foresight pack webdataset``: tar shards made here (real JPEG, FLAC, MP4 from the project's synthetic media),
packed by the real CLI from a brace pattern, read back through the Loader: payload bytes, probe meta and the
json/txt/cls fields per key."""
from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from cli_helpers import run_cli
from foresight.errors import FormatError
from foresight.format import open_dataset, pack_webdataset
from foresight.format.packers.webdataset import expand_braces, expand_shards
from foresight.loader import Loader
from foresight.plan import build_plan

synth = pytest.importorskip("foresight.testing.media_synth")


def write_tar(path, members: list[tuple[str, bytes]], mode: str = "w") -> None:
    with tarfile.open(path, mode) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two shards, three keys each: images with json+txt+cls, one audio clip, one video clip; a stray .npy."""
    root = tmp_path_factory.mktemp("wds")
    video = synth.make_video(seconds=1.0, fps=10, width=64, height=48)
    audio = synth.make_audio(seconds=0.5, codec="flac", container="flac")
    want = {}
    for s in range(2):
        members = []
        for k in range(3):
            key = f"{s:02d}{k:04d}"
            if (s, k) == (0, 1):
                payload, ext = audio, "flac"
            elif (s, k) == (1, 2):
                payload, ext = video, "mp4"
            else:
                payload, ext = synth.make_image(width=48, height=32, seed=s * 10 + k), "jpg"
            members.append((f"{key}.{ext}", payload))
            members.append((f"{key}.json", json.dumps({"url": f"http://x/{key}", "width": 48}).encode()))
            members.append((f"{key}.txt", f" caption of {key}\n".encode()))
            members.append((f"{key}.cls", str(s * 3 + k).encode()))
            if k == 0:
                members.append((f"{key}.npy", b"\x93NUMPY"))
            want[key] = (payload, ext)
        write_tar(root / f"shards-{s:06d}.tar", members, mode="w" if s == 0 else "w:gz")
    return root, want


def test_brace_and_glob_patterns():
    assert expand_braces("a-{000008..000010}.tar") == ["a-000008.tar", "a-000009.tar", "a-000010.tar"]
    assert expand_braces("{x,y}-{1..2}") == ["x-1", "x-2", "y-1", "y-2"]


def test_pack_webdataset_cli_and_read_back_through_the_loader(shards, tmp_path):
    root, want = shards
    res = run_cli("pack", "webdataset", str(root / "shards-{000000..000001}.tar"), str(tmp_path / "media"),
                  "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "packed 6 samples from 2 files" in res.stdout and "modalities=image,video,audio" in res.stdout, res.stdout
    ds = open_dataset(str(tmp_path / "media"))
    assert ds.manifest.extra["ignored_members"] == {"npy": 2} and ds.manifest.extra["skipped_count"] == 0
    plan = build_plan([(ds, 1.0)], seed=0, global_batch_size=3, num_steps=2, shuffle="global")
    seen = {}
    fields = ("key", "caption", "txt", "cls", "json", "shard", "file")
    with Loader(ds, plan, meta_fields=fields) as loader:
        for batch in loader:
            data = np.asarray(batch["data"])
            for i, sid in enumerate(batch["sample_ids"].tolist()):
                o, n = int(batch["offsets"][i]), int(batch["lengths"][i])
                seen[batch["key"][i]] = (bytes(data[o : o + n]), {f: batch[f][i] for f in fields}, sid)
    assert set(seen) == set(want)  # every key once, in a shuffled plan of one epoch
    for key, (payload, meta, sid) in seen.items():
        s, k = int(key[:2]), int(key[2:])
        assert payload == want[key][0]
        assert meta["caption"] == meta["txt"] == f"caption of {key}"
        assert meta["cls"] == s * 3 + k and meta["json"] == {"url": f"http://x/{key}", "width": 48}
        assert meta["shard"] == f"shards-{s:06d}.tar" and meta["file"] == f"{key}.{want[key][1]}"
        probed = ds.meta(sid)
        if want[key][1] == "mp4":
            assert probed["key_frames"] == [0] and probed["num_frames"] == 10  # the media probe ran
        if want[key][1] == "jpg":
            assert (probed["width"], probed["height"]) == (48, 32)


def test_glob_and_python_api_and_bad_keys(shards, tmp_path):
    root, _ = shards
    out = pack_webdataset(str(root / "shards-*.tar"), tmp_path / "g", progress=False, probe=False)
    assert open_dataset(out).num_samples == 6
    bad = tmp_path / "bad-000000.tar"
    write_tar(bad, [("a.jpg", synth.make_image(width=8, height=8)), ("a.txt", b"ok"), ("b.json", b"{}")])
    with pytest.raises(FormatError, match="key 'b' has no image, audio or video member") as info:
        pack_webdataset(str(bad), tmp_path / "bad", progress=False)
    assert str(bad) in str(info.value) and not (tmp_path / "bad").exists()
    ds = open_dataset(pack_webdataset(str(bad), tmp_path / "skip", progress=False, on_error="skip"))
    assert ds.num_samples == 1 and ds.manifest.extra["skipped"] == [f"{bad}:b"]
    with pytest.raises(FormatError, match="no such WebDataset shard"):
        expand_shards(str(tmp_path / "missing-{0..1}.tar"))
