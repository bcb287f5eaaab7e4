"""Media decode for foresight: pack-time index, frame-selective video, images, audio, transforms.

Everything here is a pure function of (bytes, pack-time meta, spec, seed, epoch, sample id), so
the storage-node daemon and the training host produce identical tensors (proved by hashes).

Example::

    from foresight.media import probe_media, decode_video, FrameSampling, TransformSpec, DecodePool
    meta = probe_media(data, "video")
    clip = decode_video(data, meta, FrameSampling(num_frames=8, window_s=4.0), seed=1, sample_id=3)
    spec = TransformSpec(modality="video", size=(224, 224), crop="random_resized", dtype="float32")
    with DecodePool(threads=2) as pool:
        batch = pool.decode(spec, datas, metas, sample_ids, seed=1, epoch=0)
"""
from .audio import decode_audio
from .image import decode_image
from .pool import BatchHandle, DecodePool, estimate_cost
from .probe import probe_media, video_pts
from .rng import keyed_rng
from .sampling import AudioSampling, FrameSampling, draw_window, sample_frame_indices
from .transforms import TransformSpec, library_versions, output_hash
from .video import decode_cost, decode_video, plan_segments

__all__ = [
    "AudioSampling",
    "BatchHandle",
    "DecodePool",
    "FrameSampling",
    "TransformSpec",
    "decode_audio",
    "decode_cost",
    "decode_image",
    "decode_video",
    "draw_window",
    "estimate_cost",
    "keyed_rng",
    "library_versions",
    "output_hash",
    "plan_segments",
    "probe_media",
    "sample_frame_indices",
    "video_pts",
]
