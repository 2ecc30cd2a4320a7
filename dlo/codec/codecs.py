"""The bitstreams a block may be encoded in, and the one this process decodes.

[Note: block codecs]
``codec="ans"`` asks for lossless entropy coding of the blocks' bytes. On CUDA the bitstream
is nvCOMP's ANS over 16-bit symbols (``data_type="<f2"``): measured on an H200, 64 MiB of
bf16 weights (random normal) encode to 0.685 of their bytes and decode at about 680 GB/s
into a preallocated buffer, with the decode config built once per piece size from the
compression config (no stream synchronization at decode). On the CPU platform, where nothing
decodes on a device, the reference codec stores the same container with zlib over the
two byte planes of each 16-bit word: it exists so the container, the plumbing and bitwise
round trips are tested without a GPU, and is not meant to be fast. A process decodes only
the bitstream it encodes (the host copy is built at enable, by this process).

nvCOMP's decoder does not validate its input: a corrupted encoded buffer faulted the device
(an illegal memory access, fatal to the CUDA context) in the probe. The encoded bytes come
from this process's own encode, a sharer's of the node-shared copy (trusted like its raw
bytes; its piece table is checked), or an encoded checkpoint read against its checksums
([Note: encoded checkpoint] in :mod:`dlo.codec.offline`). The first decode loads nvCOMP's
kernels (about 0.6 s on an H200): ``prepare`` runs one round trip of 1 MiB at enable, so
the first step does not pay it.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Protocol

import torch

from dlo.errors import OffloadError
from dlo.platform.device import Platform

logger = logging.getLogger(__name__)


class Codec(Protocol):
    bitstream: str

    def encode(self, raw: torch.Tensor) -> torch.Tensor:
        """The encoded bytes of the uint8 tensor ``raw`` (exact size, on ``raw``'s device,
        ready when this returns)."""
        ...

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Enqueue the decode of ``src`` into ``out`` (its exact raw size) on the stream the
        codec was made for."""
        ...

    def prepare(self, nbytes: int) -> None:
        """Build what decoding pieces of ``nbytes`` raw bytes needs, before any load."""
        ...


class ReferenceCodec:
    """zlib over the byte planes of 16-bit words, on the host (see [Note: block codecs])."""

    bitstream = "dlo-zlib-planes-v1"

    def __init__(self, level: int = 1) -> None:
        self.level = level

    def encode(self, raw: torch.Tensor) -> torch.Tensor:
        planes = _planes(raw.cpu())
        data = zlib.compress(planes.numpy().tobytes(), self.level)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def prepare(self, nbytes: int) -> None:
        return None

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        try:
            data = zlib.decompress(src.cpu().numpy().tobytes())
        except zlib.error as e:
            raise OffloadError(f"decoding a block piece failed: {e}") from e
        if len(data) != out.numel():
            raise OffloadError(
                f"decoding a block piece gave {len(data)} bytes, {out.numel()} expected"
            )
        planes = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if out.numel() % 2:
            out.copy_(planes)
        else:
            out.view(-1, 2).copy_(planes.view(2, -1).t())


def _planes(raw: torch.Tensor) -> torch.Tensor:
    """The low bytes of every 16-bit word, then the high bytes (one plane if odd-sized)."""
    if raw.numel() % 2:
        return raw.contiguous()
    return raw.view(-1, 2).t().contiguous().view(-1)


class AnsCodec:
    """nvCOMP's ANS, ``data_type="<f2"``, on one CUDA stream (see [Note: block codecs])."""

    bitstream = "nvcomp-ans-f2"

    def __init__(self, platform: Platform, stream: Any) -> None:
        nvcomp = import_nvcomp()
        self._nv = nvcomp
        self._stream = stream
        index = platform.device.index if platform.device.index is not None else 0
        self._codec = nvcomp.Codec(
            algorithm="ANS", data_type="<f2", cuda_stream=stream.cuda_stream, device_id=index
        )
        self._configs: dict[int, tuple[Any, Any]] = {}
        self._device = platform.device
        self._warm = False

    def _config(self, nbytes: int) -> tuple[Any, Any]:
        cfg = self._configs.get(nbytes)
        if cfg is None:
            cc = self._codec.compression_config(nbytes)
            cfg = self._configs[nbytes] = (cc, self._codec.decompression_config(cc))
        return cfg

    def prepare(self, nbytes: int) -> None:
        self._config(nbytes)
        if not self._warm:  # the first decode loads nvCOMP's kernels: at enable, not in a step
            self._warm = True
            raw = (torch.arange(1 << 20, device=self._device) % 251).to(torch.uint8)
            out = torch.empty_like(raw)
            self.decode(self.encode(raw), out)
            self._stream.synchronize()

    def _array(self, t: torch.Tensor) -> Any:
        return self._nv.as_array(t, cuda_stream=self._stream.cuda_stream)

    def encode(self, raw: torch.Tensor) -> torch.Tensor:
        cc, _ = self._config(raw.numel())
        self._stream.wait_stream(torch.cuda.current_stream(raw.device))  # raw's writer
        with torch.cuda.stream(self._stream):
            encoded = self._codec.encode(self._array(raw), compression_config=cc)
            self._stream.synchronize()
            n = int(encoded.buffer_size)
            out = torch.from_dlpack(encoded).view(torch.uint8).reshape(-1)[:n].clone()
            self._stream.synchronize()  # before nvCOMP frees its buffer
        return out

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        _, dc = self._config(out.numel())
        self._codec.decode(self._array(src), out=self._array(out), decompression_config=dc)


def import_nvcomp() -> Any:
    try:
        from nvidia import nvcomp  # type: ignore[import-not-found]
    except ImportError as e:
        raise OffloadError(
            "codec='ans' on CUDA decodes with nvCOMP, which is not installed: "
            "pip install nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13 (or codec='none')"
        ) from e
    return nvcomp


def codec_available(platform: Platform) -> bool:
    """Whether this process can encode and decode blocks on ``platform``: the reference codec
    always (no device streams), nvCOMP's where it is installed and imports (a broken install,
    whatever its import raises, is no codec: the default never fails an enable for want of an
    optional package)."""
    if not platform.has_streams:
        return True
    try:
        import_nvcomp()
    except Exception as e:  # an ImportError (OffloadError), or a broken library's OSError
        logger.debug("dlo: no device codec: %r", e)
        return False
    return True


def get_codec(platform: Platform, name: str, stream: Any) -> Codec:
    """The codec this process uses for ``name`` (not ``"none"``), decoding on ``stream``."""
    if name != "ans":  # "none" encodes nothing; "auto" is decided by the policy first
        raise ValueError(f"codec={name!r}: no codec to build (expected 'ans')")
    if platform.has_streams:
        return AnsCodec(platform, stream)
    return ReferenceCodec()
