"""Turn Python values holding tensors into frames, and back.

The codec carries column batches between processes. :func:`encode` turns a value into a
list of *frames* (bytes-like objects); :func:`decode` turns the frames back into an equal
value. Structure goes through msgpack; the bytes of tensors and numpy arrays travel
beside it, out of band, so that a transport can send them without touching them.

Format
------
Frame 0 is the *header*: a msgpack array ``["srl", FORMAT_VERSION, n_frames, body]``,
where ``n_frames`` counts every frame (header included) and ``body`` is the msgpack
encoding of the value. Frames 1.. are raw byte *segments*, referenced from the body.

In the body, ``dict``, ``list``, ``str``, ``int`` (64-bit), ``float``, ``bool``, ``None``
and ``bytes`` are plain msgpack (dict keys may be any encodable hashable value: str, int,
tuples, ...). Everything else is a msgpack ExtType whose data is small (a msgpack array,
except for big ints):

===========  ==========================================================================
ext code     meaning, data
===========  ==========================================================================
1 tuple      the items (so tuples come back as tuples, not lists)
2 tensor     ``[dtype name, shape, first frame, frame count, nbytes]`` (``"bfloat16"``)
3 ndarray    ``[numpy dtype str, shape, first frame, frame count, nbytes]`` (``"<f4"``)
4 np scalar  ``[numpy dtype str, raw bytes]`` (a numpy scalar such as ``np.float32(1)``)
5 big int    two's-complement little-endian bytes of an int outside msgpack's 64 bits
6 bytes      ``[first frame, frame count, nbytes]``: a ``bytes`` over the inline limit
7 str        ``[first frame, frame count, nbytes]``: a ``str`` over the inline limit
8 pickle     ``[type name, pickle stream or segment, [segments of pickle buffers]]``
===========  ==========================================================================

A segment (the bytes of one tensor, array, long bytes/str, pickle stream or pickle
buffer) is split over ``ceil(nbytes / chunk_size)`` consecutive frames, so that no frame
is longer than ``chunk_size`` (default 1 GiB, well under msgpack's 4 GiB limit for one
``bin`` object). Empty tensors and arrays use no frame. The header holds metadata only:
``str``/``bytes`` (and pickle streams) are inlined only up to the inline limit,
``min(INLINE_LIMIT, chunk_size // 16)``; :func:`encode` raises if the header would still
be longer than ``chunk_size``.

Tensors are sent as raw bytes plus the torch dtype name (not through numpy dtypes, which
lack bfloat16 and float8), so every non-quantized torch dtype round-trips: bool, all
int/uint widths, float16/bfloat16/float32/float64, every float8 and the sub-byte and
``bits`` dtypes, complex32/64/128. Shape and dtype round-trip exactly; strides do not
(a decoded tensor is contiguous).

Objects the codec does not handle natively (sets, dataclasses, ``OrderedDict``,
namedtuples, tensor subclasses, sparse or quantized tensors, bytearrays, ...) are pickled
(protocol 5) when ``allow_pickle=True``; pickle's out-of-band buffers become segments,
and plain tensors and numpy arrays met inside the pickled object are still sent as
segments (through pickle's persistent ids), not copied into the pickle stream. A
``TensorDict`` takes this path: its tensors travel as frames, its structure as pickle.
Decoding a pickle runs code chosen by the sender: only decode with ``allow_pickle=True``
frames from a trusted peer.

What is copied, what is not
---------------------------
encode:
  - a contiguous CPU tensor or C-contiguous numpy array is *not* copied: its frames are
    memoryviews over its memory (also with a storage offset). The frames alias it, so do
    not modify it until the frames have been sent;
  - a non-contiguous tensor or array (transposed, strided slice, expanded, Fortran
    order) is made contiguous first: one copy;
  - a tensor on another device is copied to the CPU (and decodes on the CPU);
  - a tensor with ``requires_grad`` is detached: the decoded tensor has no autograd
    history and ``requires_grad=False``; a conjugate/negative-bit view is resolved
    (one copy); ``nn.Parameter`` decodes as a plain tensor;
  - a long ``bytes`` is not copied; a long ``str`` is UTF-8 encoded (one copy); the header
    and pickle streams are built in new memory.
decode:
  - a tensor or array whose bytes are in one frame is *not* copied: it is a view over the
    frame (it keeps the frame alive). Frames given as ``bytes`` (or another read-only
    buffer) give tensors backed by read-only memory: torch cannot mark a tensor
    read-only, so writing to such a tensor writes into the frame buffer (which an
    immutable ``bytes`` must never see: clone the tensor before writing in place).
    Numpy arrays over read-only frames are read-only (``flags.writeable`` is False);
  - a segment split over several frames is joined into new memory: one copy;
  - a segment that is not aligned for its dtype (at most 8 bytes) is copied so that
    kernels see aligned memory; frames from :func:`encode`, :func:`unpack` and the usual
    transports are aligned;
  - ``bytes`` from a segment are copied unless the segment is one whole ``bytes`` frame.

:func:`pack` copies every frame once into one contiguous buffer (for transports that
need one); :func:`unpack` returns memoryviews over that buffer (no copy). Memoryviews do
not pickle: a transport that pickles (Ray) should wrap each frame, for example as
``numpy.frombuffer(frame, numpy.uint8)``, which Ray also sends without a copy.

Integers beyond 64 bits are encoded natively (ext 5), without pickle, so they also work
with ``allow_pickle=False``.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn, Union

import msgpack
import numpy as np
import torch

from streamrl.errors import EncodeError, InvalidArgument

__all__ = [
    "DEFAULT_CHUNK",
    "MAX_CHUNK",
    "INLINE_LIMIT",
    "MAX_DEPTH",
    "FORMAT_VERSION",
    "Frame",
    "encode",
    "decode",
    "frames_nbytes",
    "pack",
    "unpack",
    "dtype_name",
    "is_raw_tensor",
    "tensor_to_raw",
    "tensor_from_raw",
]

DEFAULT_CHUNK = 1 << 30
"""Default largest frame, in bytes (1 GiB)."""

MAX_CHUNK = (1 << 32) - 1
"""Largest allowed ``chunk_size``: one msgpack ``bin`` object holds at most this."""

INLINE_LIMIT = 64 * 1024
"""``bytes``, ``str`` (in characters) and pickle streams longer than this, or than
``chunk_size // 16``, go out of band instead of into the header."""

MAX_DEPTH = 256
"""Deepest nesting of containers that :func:`encode` accepts (msgpack allows 511)."""

FORMAT_VERSION = 1

Frame = Union[bytes, bytearray, memoryview, np.ndarray]
"""A frame: any C-contiguous buffer (``encode`` returns ``bytes`` and memoryviews)."""

_MAGIC = "srl"
_PID = "streamrl"  # tag of the persistent ids that stand for tensors inside pickles

_EXT_TUPLE = 1
_EXT_TENSOR = 2
_EXT_NDARRAY = 3
_EXT_NPSCALAR = 4
_EXT_BIGINT = 5
_EXT_BYTES = 6
_EXT_STR = 7
_EXT_PICKLE = 8

_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
_UNICODE_ERRORS = "surrogatepass"  # lone surrogates in str round-trip
_NUMPY_KINDS = frozenset("biufcmMSU")  # numpy dtypes whose values are plain bytes
_MAX_ALIGN = 8

_NOT_WRITABLE = "The given buffer is not writable"


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype in encoded data (``"float32"``, ``"bfloat16"``...);
    :func:`tensor_from_raw` takes it back."""
    return str(dtype).removeprefix("torch.")


_dtype_name = dtype_name  # (the name inside this module)


# Quantized dtypes need a quantizer (scale, zero point) besides their bytes; they go
# through pickle, so a header naming one is refused.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    _dtype_name(d): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and not _dtype_name(d).startswith(("qint", "quint"))
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` in encoded data (the inverse of :func:`dtype_name`).
    A name that is none (or a quantized one) fails as a corrupt frame, as in
    :func:`tensor_from_raw`."""
    dt = _TORCH_DTYPES.get(name) if type(name) is str else None
    if dt is None:
        _fail(f"unknown torch dtype {name!r}")
    return dt


def _type_name(cls: type) -> str:
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _byte_view(frame: Any) -> memoryview:
    """A flat unsigned-byte memoryview of ``frame``, without copying."""
    view = memoryview(frame)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    return view.cast("B")  # raises TypeError for a non-contiguous buffer


def _check_chunk_size(chunk_size: int) -> None:
    if type(chunk_size) is not int or not 1 <= chunk_size <= MAX_CHUNK:
        raise InvalidArgument(
            f"chunk_size must be an int between 1 and {MAX_CHUNK} (msgpack's limit for "
            f"one bin object), got {chunk_size!r}; the default is {DEFAULT_CHUNK}"
        )


# --------------------------------------------------------------------------- encoding


class _Unencodable(Exception):
    """Raised inside the encoder; carries the path built while unwinding."""

    def __init__(self, obj: Any, reason: str, hint: str):
        super().__init__(reason)
        self.type_name = _type_name(type(obj))
        self.reason = reason
        self.hint = hint
        self.path: list[str] = []  # innermost first

    def to_error(self, name: str) -> EncodeError:
        path = name + "".join(reversed(self.path))
        return EncodeError(f"cannot encode {self.type_name} at {path}: {self.reason}. {self.hint}")


_NATIVE = (
    "dict, list, tuple, str, int, float, bool, None, bytes, torch.Tensor, numpy.ndarray "
    "and numpy scalars"
)


def is_raw_tensor(t: torch.Tensor) -> bool:
    """Whether the tensor is described by its dtype, shape and bytes alone (strided,
    not quantized): what :func:`tensor_to_raw` takes; other tensors are pickled."""
    return t.layout is torch.strided and not t.is_quantized


_raw_tensor = is_raw_tensor  # (the name inside this module)


def _raw_numpy(dtype: np.dtype) -> bool:
    return dtype.kind in _NUMPY_KINDS and not dtype.hasobject


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in row-major order as a flat uint8 tensor.

    A view of ``t``'s storage when ``t`` is contiguous, else a new tensor (one copy). The
    bytes are gathered as uint8, which works for every dtype, including the sub-byte ones
    that have no copy kernel.
    """
    size = t.element_size()
    raw = torch.empty(0, dtype=torch.uint8)
    offset = t.storage_offset() * size
    if t.is_contiguous():
        return raw.set_(t.untyped_storage(), offset, (t.numel() * size,), (1,))
    strided = raw.set_(
        t.untyped_storage(), offset, (*t.shape, size), (*(s * size for s in t.stride()), 1)
    )
    return strided.contiguous().view(-1)


class _Pickler(pickle.Pickler):
    """Pickler that sends plain tensors and numpy arrays as frames, not in the stream."""

    def __init__(self, file: io.BytesIO, encoder: _Encoder, buffers: list[pickle.PickleBuffer]):
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._encoder = encoder

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor and _raw_tensor(obj):
            return (_PID, _EXT_TENSOR, self._encoder.tensor_ref(obj))
        if cls is np.ndarray and _raw_numpy(obj.dtype):
            return (_PID, _EXT_NDARRAY, self._encoder.ndarray_ref(obj))
        return None


class _Encoder:
    def __init__(self, chunk_size: int, allow_pickle: bool):
        self.chunk_size = chunk_size
        self.allow_pickle = allow_pickle
        self.frames: list[Any] = [b""]  # slot 0 is the header, filled in last
        self.inline_limit = min(INLINE_LIMIT, chunk_size // 16)

    def segment(self, data: memoryview) -> list[int]:
        """Append ``data`` as frames of at most chunk_size bytes; return its reference."""
        first, nbytes, step = len(self.frames), data.nbytes, self.chunk_size
        self.frames.extend(data[start : start + step] for start in range(0, nbytes, step))
        return [first, len(self.frames) - first, nbytes]

    # -- tensors and arrays

    def tensor_ref(self, t: torch.Tensor) -> list[Any]:
        if t.device.type != "cpu":
            try:
                t = t.cpu()
            except (NotImplementedError, RuntimeError) as exc:
                raise _Unencodable(
                    t,
                    f"its data cannot be read on the CPU ({t.device} tensor: {exc})",
                    "Send a tensor that holds data (not on the meta device).",
                ) from exc
        t = t.detach().resolve_conj().resolve_neg()
        meta: list[Any] = [_dtype_name(t.dtype), list(t.shape)]
        if t.numel() == 0:
            return [*meta, 0, 0, 0]
        return [*meta, *self.segment(_tensor_bytes(t).numpy().data)]

    def ndarray_ref(self, a: np.ndarray) -> list[Any]:
        meta: list[Any] = [a.dtype.str, list(a.shape)]
        if a.nbytes == 0:
            return [*meta, 0, 0, 0]
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        return [*meta, *self.segment(flat.data)]

    # -- the walk

    def walk(self, obj: Any, depth: int = 0) -> Any:
        """``obj`` as a msgpack-ready tree (segments appended to self.frames)."""
        cls = type(obj)
        if cls is str:
            if len(obj) <= self.inline_limit:
                return obj
            data = obj.encode("utf-8", _UNICODE_ERRORS)
            return self._ext(_EXT_STR, self.segment(memoryview(data)))
        if cls is int:
            if _INT_MIN <= obj <= _INT_MAX:
                return obj
            data = obj.to_bytes(obj.bit_length() // 8 + 1, "little", signed=True)
            return msgpack.ExtType(_EXT_BIGINT, data)
        if obj is None or cls is float or cls is bool:
            return obj
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            if _raw_tensor(obj):
                return self._ext(_EXT_TENSOR, self.tensor_ref(obj))
            return self.pickled(obj)
        if cls is dict or cls is list or cls is tuple:
            if depth >= MAX_DEPTH:
                raise _Unencodable(
                    obj,
                    f"containers are nested more than {MAX_DEPTH} levels deep",
                    "Flatten the structure (for example into tensors or a list of records).",
                )
            if cls is dict:
                return self._walk_dict(obj, depth + 1)
            if cls is list:
                return self._walk_items(obj, depth + 1)
            return self._ext(_EXT_TUPLE, self._walk_items(obj, depth + 1))
        if cls is bytes:
            if len(obj) <= self.inline_limit:
                return obj
            return self._ext(_EXT_BYTES, self.segment(memoryview(obj)))
        if cls is np.ndarray and _raw_numpy(obj.dtype):
            return self._ext(_EXT_NDARRAY, self.ndarray_ref(obj))
        if isinstance(obj, np.generic) and _raw_numpy(obj.dtype):
            return self._ext(_EXT_NPSCALAR, [obj.dtype.str, obj.tobytes()])
        return self.pickled(obj)

    def _walk_items(self, items: list[Any] | tuple[Any, ...], depth: int) -> list[Any]:
        out = []
        for index, item in enumerate(items):
            try:
                out.append(self.walk(item, depth))
            except _Unencodable as exc:
                exc.path.append(f"[{index}]")
                raise
        return out

    def _walk_dict(self, mapping: dict[Any, Any], depth: int) -> dict[Any, Any]:
        out = {}
        for key, value in mapping.items():
            try:
                packed_key = self.walk(key, depth)
            except _Unencodable as exc:
                exc.path.append(f" (the dict key {key!r})")
                raise
            try:
                out[packed_key] = self.walk(value, depth)
            except _Unencodable as exc:
                exc.path.append(f"[{key!r}]")
                raise
        return out

    @staticmethod
    def _ext(code: int, data: Any) -> msgpack.ExtType:
        return msgpack.ExtType(code, msgpack.packb(data, unicode_errors=_UNICODE_ERRORS))

    def pickled(self, obj: Any) -> msgpack.ExtType:
        if not self.allow_pickle:
            raise _Unencodable(
                obj,
                f"the codec encodes {_NATIVE} natively, and pickle fallback is off "
                "(allow_pickle=False)",
                "Convert it to one of those types (for example a dataclass to a dict), "
                "or encode with allow_pickle=True.",
            )
        stream = io.BytesIO()
        buffers: list[pickle.PickleBuffer] = []
        try:
            _Pickler(stream, self, buffers).dump(obj)
        except _Unencodable:
            raise
        except Exception as exc:  # pickle raises many types (PicklingError, TypeError, ...)
            raise _Unencodable(
                obj,
                f"it is not one of {_NATIVE}, and pickle failed ({type(exc).__name__}: {exc})",
                "Only data can be sent to another process: send something picklable "
                "instead (for example a name or config to rebuild it from), or leave it "
                "out of the batch.",
            ) from exc
        payload = stream.getbuffer()
        body: Any = bytes(payload) if payload.nbytes <= self.inline_limit else self.segment(payload)
        refs = [self.segment(_byte_view(buffer.raw())) for buffer in buffers]
        return self._ext(_EXT_PICKLE, [_type_name(type(obj)), body, refs])


def encode(
    obj: Any,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    allow_pickle: bool = True,
    name: str = "obj",
) -> list[bytes | memoryview]:
    """Encode ``obj`` into frames.

    Args:
        obj: the value: dicts, lists, tuples, str, int, float, bool, None, bytes, torch
            tensors, numpy arrays and scalars, nested freely; other objects are pickled
            when ``allow_pickle`` is true.

    Keyword Args:
        chunk_size: largest frame in bytes (1 to MAX_CHUNK). Longer segments are split
            over several frames.
        allow_pickle: pickle (protocol 5) what msgpack cannot encode. When false, such an
            object raises :class:`EncodeError` instead.
        name: what to call ``obj`` in error messages (``columns`` gives paths like
            ``columns['chat'][3]``).

    Returns:
        The frames: frame 0 is the msgpack header (``bytes``), the others are memoryviews
        over tensor/array/bytes memory (no copy for contiguous CPU tensors and
        C-contiguous arrays; see the module docstring for what is copied). They alias
        the encoded tensors: do not modify those until the frames are sent.

    Raises:
        EncodeError: an object cannot be encoded (not picklable, or pickle is off); the
            message names its type and path. Also when the header (the metadata) is
            longer than ``chunk_size``.
        InvalidArgument: ``chunk_size`` is out of range.

    Examples:
        >>> import torch
        >>> frames = encode({"ids": torch.arange(4), "uid": ("a", 1)})
        >>> len(frames)
        2
        >>> decode(frames)["uid"]
        ('a', 1)
    """
    _check_chunk_size(chunk_size)
    encoder = _Encoder(chunk_size, allow_pickle)
    try:
        tree = encoder.walk(obj)
    except _Unencodable as exc:
        raise exc.to_error(name) from exc.__cause__
    body = msgpack.packb(tree, unicode_errors=_UNICODE_ERRORS)
    frames = encoder.frames
    header = msgpack.packb([_MAGIC, FORMAT_VERSION, len(frames), body])
    if len(header) > chunk_size:
        raise EncodeError(
            f"cannot encode {name}: its metadata (header frame) is {len(header)} bytes, more "
            f"than chunk_size={chunk_size}. Raise chunk_size, or move bulk data out of "
            "nested Python lists and strings into tensors, arrays or bytes."
        )
    frames[0] = header
    return frames


# --------------------------------------------------------------------------- decoding


class _Corrupt(Exception):
    """Raised inside the decoder for frames that do not make sense."""


def _fail(message: str) -> NoReturn:
    raise _Corrupt(message)


def _shape(value: Any) -> tuple[int, ...]:
    if type(value) is not list or not all(type(d) is int and d >= 0 for d in value):
        _fail(f"bad shape {value!r}")
    return tuple(value)


def _torch_bytes(buffer: memoryview | bytearray) -> torch.Tensor:
    """A flat uint8 tensor over ``buffer``, without copying."""
    if isinstance(buffer, memoryview) and buffer.readonly:
        # torch warns that it cannot protect read-only memory; the module docstring
        # documents it, so only that warning is silenced here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NOT_WRITABLE, category=UserWarning)
            return torch.frombuffer(buffer, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buffers: list[Any], decoder: _Decoder):
        super().__init__(file, buffers=buffers)
        self._decoder = decoder

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is not tuple or len(pid) != 3 or pid[0] != _PID:
            _fail(f"unknown persistent id {pid!r} in a pickle")
        _, kind, meta = pid
        if kind == _EXT_TENSOR:
            return self._decoder.tensor(meta)
        if kind == _EXT_NDARRAY:
            return self._decoder.ndarray(meta)
        _fail(f"unknown persistent id kind {kind!r} in a pickle")


class _Decoder:
    def __init__(self, frames: Sequence[Frame], allow_pickle: bool):
        self.allow_pickle = allow_pickle
        self.views: list[memoryview] = []
        for index, frame in enumerate(frames):
            try:
                self.views.append(_byte_view(frame))
            except (TypeError, ValueError) as exc:
                _fail(
                    f"frame {index} is a {_type_name(type(frame))}, not a contiguous "
                    f"bytes-like object ({exc})"
                )

    def load(self) -> Any:
        if not self.views:
            _fail("no frames (there must be at least the header frame)")
        envelope = self._unpack(self.views[0])
        if type(envelope) is not list or len(envelope) != 4 or envelope[0] != _MAGIC:
            _fail("frame 0 is not a streamrl codec header")
        _, version, count, body = envelope
        if version != FORMAT_VERSION:
            _fail(
                f"the frames use codec format version {version!r}; this codec reads "
                f"version {FORMAT_VERSION}"
            )
        if count != len(self.views):
            _fail(f"the header announces {count!r} frames but {len(self.views)} were given")
        if type(body) is not bytes:
            _fail("the header body is not a msgpack bin")
        return self._unpack(body)

    def _unpack(self, data: Any) -> Any:
        return msgpack.unpackb(
            data, ext_hook=self.ext, strict_map_key=False, unicode_errors=_UNICODE_ERRORS
        )

    def ext(self, code: int, data: bytes) -> Any:
        if code == _EXT_BIGINT:
            return int.from_bytes(data, "little", signed=True)
        value = self._unpack(data)
        if code == _EXT_TUPLE:
            if type(value) is not list:
                _fail("a tuple ext does not hold an array")
            return tuple(value)
        if code == _EXT_TENSOR:
            return self.tensor(value)
        if code == _EXT_NDARRAY:
            return self.ndarray(value)
        if code == _EXT_NPSCALAR:
            dtype_str, raw = value
            dtype = self._numpy_dtype(dtype_str)
            if type(raw) is not bytes or len(raw) != dtype.itemsize:
                _fail(f"a numpy scalar of dtype {dtype_str!r} needs {dtype.itemsize} bytes")
            return np.frombuffer(raw, dtype=dtype)[0]
        if code == _EXT_BYTES:
            seg = self.segment(*value)
            if (isinstance(seg, memoryview) and type(seg.obj) is bytes
                    and seg.nbytes == len(seg.obj)):
                return seg.obj  # the frame itself: no copy
            return bytes(seg)
        if code == _EXT_STR:
            return str(self.segment(*value), "utf-8", _UNICODE_ERRORS)
        if code == _EXT_PICKLE:
            return self.unpickle(value)
        _fail(f"unknown ext type {code}")

    def segment(self, first: Any, count: Any, nbytes: Any) -> memoryview | bytearray:
        """The bytes of one segment: a view of its frame, or its frames joined (a copy)."""
        if not all(type(v) is int for v in (first, count, nbytes)):
            _fail("a segment reference is not three ints")
        if count == 0 and nbytes == 0:  # an empty pickle buffer, for example
            return memoryview(b"")
        if first < 1 or count < 1 or first + count > len(self.views):
            _fail(f"a segment refers to frames {first}..{first + count - 1} of {len(self.views)}")
        parts = self.views[first : first + count]
        if count == 1:
            if parts[0].nbytes != nbytes:
                _fail(f"frame {first} has {parts[0].nbytes} bytes, the header says {nbytes}")
            return parts[0]
        total = sum(part.nbytes for part in parts)
        if total != nbytes:
            last = first + count - 1
            _fail(f"frames {first}..{last} hold {total} bytes, the header says {nbytes}")
        joined = bytearray(nbytes)
        position = 0
        for part in parts:
            joined[position : position + part.nbytes] = part
            position += part.nbytes
        return joined

    def tensor(self, meta: Any) -> torch.Tensor:
        name, shape, first, count, nbytes = meta
        dtype = _TORCH_DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            _fail(f"unknown torch dtype {name!r}")
        shape = _shape(shape)
        if math.prod(shape) * dtype.itemsize != nbytes:
            _fail(f"a {name} tensor of shape {list(shape)} cannot have {nbytes!r} bytes")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        flat = _torch_bytes(self.segment(first, count, nbytes))
        if flat.data_ptr() % min(dtype.itemsize, _MAX_ALIGN):
            flat = flat.clone()
        return flat.view(dtype).view(shape)

    @staticmethod
    def _numpy_dtype(dtype_str: Any) -> np.dtype:
        if type(dtype_str) is not str:
            _fail(f"bad numpy dtype {dtype_str!r}")
        try:
            dtype = np.dtype(dtype_str)
        except TypeError:
            _fail(f"unknown numpy dtype {dtype_str!r}")
        if not _raw_numpy(dtype):
            _fail(f"numpy dtype {dtype_str!r} cannot be rebuilt from raw bytes")
        return dtype

    def ndarray(self, meta: Any) -> np.ndarray:
        dtype_str, shape, first, count, nbytes = meta
        dtype = self._numpy_dtype(dtype_str)
        shape = _shape(shape)
        if math.prod(shape) * dtype.itemsize != nbytes:
            _fail(f"a {dtype_str} array of shape {list(shape)} cannot have {nbytes!r} bytes")
        if nbytes == 0:
            return np.empty(shape, dtype=dtype)
        flat = np.frombuffer(self.segment(first, count, nbytes), dtype=np.uint8)
        if flat.ctypes.data % min(dtype.alignment, _MAX_ALIGN):
            flat = flat.copy()
        return flat.view(dtype).reshape(shape)

    def unpickle(self, meta: Any) -> Any:
        type_name, body, refs = meta
        if not self.allow_pickle:
            raise EncodeError(
                f"the frames hold a pickled {type_name}, and decoding it would run pickle, "
                "which is off (allow_pickle=False). Pass allow_pickle=True only for frames "
                "from a trusted sender, or send the value as plain data."
            )
        stream = body if type(body) is bytes else self.segment(*body)
        buffers = [self.segment(*ref) for ref in refs]
        try:
            return _Unpickler(io.BytesIO(stream), buffers, self).load()
        except _Corrupt:
            raise
        except Exception as exc:
            _fail(f"unpickling a {type_name} failed ({type(exc).__name__}: {exc})")


def decode(frames: Sequence[Frame], *, allow_pickle: bool = True) -> Any:
    """Decode frames made by :func:`encode` back into the value.

    Args:
        frames: the frames, in order: ``bytes``, ``bytearray``, memoryviews, numpy uint8
            arrays or any other C-contiguous buffers.

    Keyword Args:
        allow_pickle: rebuild pickled objects. Unpickling runs code chosen by the sender;
            pass False for frames from an untrusted peer (a pickled object then raises).

    Returns:
        The value. Tensors and arrays whose bytes fit in one frame are views over that
        frame, not copies (they keep it alive; see the module docstring): with read-only
        frames such as ``bytes``, writing into a decoded tensor writes into the frame.

    Raises:
        EncodeError: the frames are corrupt, truncated, out of order or not from
            :func:`encode`; or they hold a pickle and ``allow_pickle`` is false.
    """
    if isinstance(frames, (bytes, bytearray, memoryview)):
        raise EncodeError(
            "decode takes the list of frames, got one bytes-like object; if it came from "
            "pack(), call decode(unpack(data))"
        )
    try:
        return _Decoder(frames, allow_pickle).load()
    except EncodeError:
        raise
    except Exception as exc:  # anything the frames can make msgpack, numpy or torch raise
        reason = str(exc) if isinstance(exc, _Corrupt) else f"{type(exc).__name__}: {exc}"
        raise EncodeError(
            f"cannot decode the frames: {reason}. They are corrupt, truncated or out of "
            "order, or were not made by streamrl.codec.encode (of the same format version)."
        ) from exc


# --------------------------------------------------------------------------- helpers


def frames_nbytes(frames: Sequence[Frame]) -> int:
    """Total number of bytes in ``frames`` (header included)."""
    return sum(_byte_view(frame).nbytes for frame in frames)


_PACK_MAGIC = b"SRLP"
_PACK_PREFIX = struct.Struct("<4sI")  # magic, frame count; then one u64 length per frame
_PACK_ALIGN = 64


def pack(frames: Sequence[Frame]) -> bytes:
    """Copy ``frames`` into one buffer (for transports that carry a single buffer).

    Layout: ``b"SRLP"``, the frame count (u32 little-endian), one u64 little-endian
    length per frame, then the frames, each starting at an offset that is a multiple of
    64 (zero padding between them). Every frame is copied once.
    """
    views = [_byte_view(frame) for frame in frames]
    parts: list[Any] = [
        _PACK_PREFIX.pack(_PACK_MAGIC, len(views)),
        struct.pack(f"<{len(views)}Q", *(view.nbytes for view in views)),
    ]
    position = _PACK_PREFIX.size + 8 * len(views)
    for view in views:
        padding = -position % _PACK_ALIGN
        parts.append(bytes(padding))
        parts.append(view)
        position += padding + view.nbytes
    return b"".join(parts)


def unpack(data: Frame) -> list[memoryview]:
    """Split a buffer made by :func:`pack` back into frames.

    Returns memoryviews over ``data`` (no copy; they keep ``data`` alive).

    Raises:
        EncodeError: ``data`` is not a complete buffer made by :func:`pack`.
    """
    view = _byte_view(data)
    if view.nbytes < _PACK_PREFIX.size:
        raise EncodeError(
            f"cannot unpack {view.nbytes} bytes: too short for a packed-frames buffer"
        )
    magic, count = _PACK_PREFIX.unpack_from(view)
    lengths_end = _PACK_PREFIX.size + 8 * count
    if magic != _PACK_MAGIC or lengths_end > view.nbytes:
        raise EncodeError("cannot unpack: the buffer was not made by streamrl.codec.pack")
    frames: list[memoryview] = []
    position = lengths_end
    for length in struct.unpack_from(f"<{count}Q", view, _PACK_PREFIX.size):
        position += -position % _PACK_ALIGN
        if position + length > view.nbytes:
            raise EncodeError(
                f"cannot unpack: frame {len(frames)} ({length} bytes at offset {position}) "
                f"runs past the end of the {view.nbytes}-byte buffer; it is truncated"
            )
        frames.append(view[position : position + length])
        position += length
    if position != view.nbytes:
        raise EncodeError(
            f"cannot unpack: {view.nbytes - position} bytes follow the last frame; "
            "the buffer is corrupt"
        )
    return frames


#: real dtypes whose CPU tensors numpy views as they are -> name (a tensor with the
#: negative bit, such as the ``imag`` of a conjugated view, takes the general path)
_NUMPY_VIEWABLE = {d: _dtype_name(d) for d in (
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


def tensor_to_raw(t: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """``(dtype name, shape, bytes)`` of a CPU tensor: the bytes as a flat numpy ``uint8``
    array, a view of ``t`` when it is contiguous (else one copy). Every raw dtype works,
    including bfloat16 and float8 that numpy cannot represent."""
    name = _NUMPY_VIEWABLE.get(t.dtype)
    if (name is not None and t.is_contiguous() and t.device.type == "cpu"
            and not t.requires_grad and not t.is_neg()):
        # the common case, through numpy's view of the tensor: half the cost of building
        # a uint8 tensor over its storage (a one-row put's tensors take 2-4 us this way)
        return name, tuple(t.shape), t.numpy().reshape(-1).view(np.uint8)
    if t.device.type != "cpu":
        t = t.cpu()
    if t.requires_grad:
        t = t.detach()
    t = t.resolve_conj().resolve_neg()
    return _dtype_name(t.dtype), tuple(t.shape), _tensor_bytes(t).numpy()


def tensor_from_raw(dtype: str, shape: Sequence[int], buf: Any) -> torch.Tensor:
    """The inverse of :func:`tensor_to_raw`: a tensor over ``buf`` without copying (unless
    ``buf`` is misaligned for the dtype). ``buf`` may be read-only memory (for example a
    Ray object): writing to the tensor then writes into that memory."""
    dt = torch_dtype(dtype)
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dt)
    flat = _torch_bytes(_byte_view(buf))
    if flat.data_ptr() % min(dt.itemsize, _MAX_ALIGN):
        flat = flat.clone()
    return flat.view(dt).view(shape)
