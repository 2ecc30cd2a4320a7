"""Lossless block codecs: a block's host copy stored compressed, decoded on the device.

:mod:`dlo.codec.format` is dlo's container (the pieces of one encoded block);
:mod:`dlo.codec.codecs` the bitstreams: nvCOMP's ANS on CUDA, a CPU reference codec
elsewhere (see [Note: block codecs])."""
