"""The disk tier of a codec's stacks at enable: the blocks ``host_budget_gb`` leaves on disk
served by the encoded checkpoint beside their weights, the blocks that file lacks encoded
into it first, and the encoded sizes the tiers are chosen by (see [Note: encoded blocks on
disk] in :mod:`dlo.codec.on_disk`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from dlo.backends.layer_codec import Block, HostCodec
from dlo.codec.blocks import encode_packed, pack_raw
from dlo.codec.format import EncodedLayout, write_pieces
from dlo.codec.offline import ENCODED_FILE, Origin
from dlo.codec.on_disk import EncodedOnDisk
from dlo.codec.spool import EncodedSpool, spool_reserve
from dlo.errors import OffloadError
from dlo.io.direct import DirectReads
from dlo.io.files import CheckpointWriteError, locked_dir
from dlo.journal import Journal
from dlo.plan.layout import BlockLayout

logger = logging.getLogger(__name__)


def serve_on_disk(
    codec: HostCodec,
    blocks: Sequence[Block],
    reads: DirectReads,
    journal: Journal,
    kept: Sequence[Block] = (),
) -> list[EncodedOnDisk]:
    """``blocks`` (group size 1) served by their encoded checkpoint at every use; the files
    stay open until the journal is undone. Blocks it does not serve yet are encoded into it
    first, one at a time (:func:`_encode_into`), and so are the ``kept`` ones (the host
    region's encoded blocks) that come from a checkpoint: later enables read them too.

    Raises:
        ValueError: a block's tensors are not all in one checkpoint directory (no encoded
            checkpoint can serve it), or the file cannot be written (named).
    """
    for index, name, layout, tensors, _ in blocks:
        origin = codec.origin(index, layout, tensors)
        if origin is None or origin.directory is None:
            raise ValueError(
                f"host_budget_gb leaves block {name!r} on disk, where codec {codec.name!r} "
                "reads it from the encoded checkpoint beside its weights, but its tensors "
                "are not all in one checkpoint directory: load the model with "
                "dlo.load_pipeline (not copy=True, no dtype cast), or set codec='none'"
            )
    missing = _missing(codec, blocks)
    for path, todo in _missing(codec, kept).items():  # beside the disk blocks, where written
        if path in missing:
            missing[path].extend(todo)
    for path, todo in missing.items():
        _encode_into(codec, path, todo)
    return [_serve(codec, b, reads, journal) for b in blocks]


def file_nbytes(codec: HostCodec, blocks: Sequence[Block]) -> dict[int, int]:
    """The encoded bytes of each of ``blocks`` (group size 1) in the encoded checkpoint
    beside its weights, by manifest position: what its host copy takes in the budget (see
    [Note: host budget tiers] in :mod:`dlo.plan.host_tiers`). The blocks the file lacks are
    encoded into it first (the enable that leaves any block on disk writes them all anyway);
    a block no file can serve, or whose file could not be written (logged, and not tried
    again this enable: :attr:`HostCodec.failed_writes`), is left out: the tiers count its
    raw bytes."""
    for path, todo in _missing(codec, blocks).items():
        try:
            _encode_into(codec, path, todo)
        except ValueError as e:  # a read-only folder, a full disk: the disk blocks' serve
            codec.failed_writes[path] = e  # names it where the file lacks any (not written twice)
            logger.warning(
                "dlo: the host budget counts raw bytes for %d block(s): %s", len(todo), e
            )
    out: dict[int, int] = {}
    for index, _, layout, tensors, _ in blocks:
        served = _served(codec, layout, codec.origin(index, layout, tensors))
        if isinstance(served, EncodedLayout):
            out[index] = served.nbytes
    return out


def _missing(codec: HostCodec, blocks: Sequence[Block]) -> dict[Path, list[Block]]:
    """``blocks`` the encoded checkpoint beside their weights does not serve yet, by that
    file (a block whose tensors are not all in one checkpoint directory is left out)."""
    missing: dict[Path, list[Block]] = {}
    for block in blocks:
        index, _, layout, tensors, _ = block
        origin = codec.origin(index, layout, tensors)
        if origin is None or origin.directory is None:
            continue
        if not isinstance(_served(codec, layout, origin), EncodedLayout):
            missing.setdefault(origin.directory / ENCODED_FILE, []).append(block)
    return missing


def _served(codec: HostCodec, layout: BlockLayout, origin: Origin | None) -> EncodedLayout | str:
    found = codec.files.entry(layout, origin, codec.bitstream)
    return found if isinstance(found, str) else found[0]


def _encode_into(codec: HostCodec, path: Path, todo: Sequence[Block]) -> None:
    """Encode ``todo`` into the encoded checkpoint at ``path``, which keeps the blocks it
    held: one block in memory at a time, the file rewritten once (under a lock on its
    directory: ranks sharing the folder encode it once, the others read it)."""
    if path in codec.failed_writes:  # tried this enable already
        raise codec.failed_writes[path]
    with locked_dir(path.parent):
        codec.files.forget(path)  # another rank may have written it meanwhile
        todo = [
            b
            for b in todo
            if not isinstance(_served(codec, b[2], codec.origins[b[0]]), EncodedLayout)
        ]
        if not todo:
            return
        logger.warning(
            "dlo: encoding %d block(s) into %s for host_budget_gb (once: later enables read them)",
            len(todo),
            path,
        )
        spool: EncodedSpool | None = None
        try:
            spool = EncodedSpool(
                path, spool_reserve([b[2] for b in todo], codec.files.num_entries(path))
            )
            codec.files.copy_into(spool, skip={b[1] for b in todo})
            for index, name, layout, tensors, _ in todo:
                raw = pack_raw(layout, tensors, codec.bounces[0])
                enc, datas = encode_packed(
                    codec.platform, codec.codec, name, layout, raw, codec.bounces[1]
                )
                data = torch.empty(enc.nbytes, dtype=torch.uint8)
                write_pieces(data, enc, datas)
                spool.add(layout, codec.origins[index], enc, data)
                del data, datas
            codec.files.forget(path)
            spool.finish(codec.bitstream)
        except (CheckpointWriteError, OSError) as e:  # read-only folder, full disk
            raise ValueError(
                f"host_budget_gb with codec {codec.name!r} encodes the blocks it leaves on "
                f"disk into {path}, which could not be written ({e}): write it where the "
                f"weights are writable (dlo run --pipeline DIR --codec {codec.name} "
                "--save-encoded, without a budget), or set codec='none'"
            ) from e
        finally:
            try:
                if spool is not None:
                    spool.close()
            finally:
                codec.release_bounces()


def _serve(codec: HostCodec, block: Block, reads: DirectReads, journal: Journal) -> EncodedOnDisk:
    index, name, layout, _, _ = block
    found = codec.files.entry(layout, codec.origins.get(index), codec.bitstream)
    if isinstance(found, str) or isinstance(found[0], str):  # encoded just now: a bug
        raise OffloadError(f"the encoded checkpoint does not serve block {name!r}: {found}")
    enc, f = found
    assert not isinstance(enc, str)
    ckpt = f.checkpoint
    if all(c is not ckpt for c in codec.retained):
        ckpt.retain()
        codec.retained.append(ckpt)
        journal.record("encoded checkpoint on disk", ckpt.release)
    reads.file(ckpt, ckpt.entries[name].file)  # opened now: its stamp is the enable's
    return EncodedOnDisk(name, enc, ckpt, reads, codec.decoder)
