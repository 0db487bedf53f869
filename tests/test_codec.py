"""Tests of streamrl.codec: round trips, chunking, zero copy, errors, pack/unpack."""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import warnings
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from streamrl.codec import (
    DEFAULT_CHUNK,
    INLINE_LIMIT,
    MAX_CHUNK,
    MAX_DEPTH,
    decode,
    encode,
    frames_nbytes,
    pack,
    unpack,
)
from streamrl.errors import EncodeError, InvalidArgument

# ----------------------------------------------------------------------------- helpers


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` in row-major order (needs a dtype with a copy kernel)."""
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


def address(buffer: Any) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


def inside(pointer: int, buffer: Any) -> bool:
    start = address(buffer)
    return start <= pointer < start + memoryview(buffer).nbytes


def assert_same(a: Any, b: Any, path: str = "obj") -> None:
    """``a`` and ``b`` are equal and of exactly the same types, all the way down."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert raw_bytes(a) == raw_bytes(b), path
    elif isinstance(a, np.ndarray):
        assert (a.dtype.str, a.shape) == (b.dtype.str, b.shape), path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{index}]")
    elif isinstance(a, float):
        same_nan = math.isnan(a) and math.isnan(b)
        assert same_nan or (a == b and math.copysign(1, a) == math.copysign(1, b)), path
    else:
        assert a == b, path


def round_trip(obj: Any, **kwargs: Any) -> Any:
    """Encode, turn every frame into immutable bytes (as a transport would), decode."""
    return decode([bytes(frame) for frame in encode(obj, **kwargs)])


def creatable_dtypes() -> list[torch.dtype]:
    """Every torch dtype that can hold data on the CPU, except the quantized ones."""
    found = []
    for dtype in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # complex32 is "experimental"
                t = torch.empty(2, dtype=dtype)
        except Exception:
            continue
        if not t.is_quantized:
            found.append(dtype)
    return found


DTYPES = creatable_dtypes()


def test_dtype_discovery_finds_the_interesting_dtypes():
    names = {str(d) for d in DTYPES}
    for expected in ["torch.bfloat16", "torch.float16", "torch.float8_e4m3fn", "torch.float8_e5m2",
                     "torch.complex32", "torch.complex128", "torch.bool", "torch.uint16",
                     "torch.uint32", "torch.uint64", "torch.int8", "torch.int64"]:
        assert expected in names


# ------------------------------------------------------------------------------ dtypes


def _views(dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Views of a 4x5 tensor of random bytes, each with the uint8 bytes it should send.

    The expected bytes come from the uint8 source (shape 4x5xitemsize), so they do not
    depend on which dtypes have torch kernels.
    """
    size = torch.empty(0, dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(0, 256, (4, 5, size), dtype=torch.uint8, generator=generator)
    t = source.view(dtype)[..., 0]
    return {
        "contiguous": (t, source),
        "transposed": (t.T, source.transpose(0, 1)),
        "strided": (t[::2, 1::2], source[::2, 1::2]),
        "offset": (t[1:], source[1:]),
        "offset-strided": (t[1:, 3], source[1:, 3]),
        "zero-dim": (t[2, 3], source[2, 3]),
        "empty-rows": (t[:0], source[:0]),
        "empty-cols": (t[:, :0].T, source[:, :0].transpose(0, 1)),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_in_every_layout(dtype):
    for layout, (tensor, source) in _views(dtype).items():
        assert tensor.dtype == dtype
        out = round_trip({"x": tensor})["x"]
        assert type(out) is torch.Tensor, layout
        assert out.dtype == dtype, layout
        assert out.shape == tensor.shape, layout
        expected = source.contiguous().numpy().tobytes()
        assert out.reshape(-1).view(torch.uint8).numpy().tobytes() == expected, layout


def test_float_values_survive_exactly():
    t = torch.tensor([0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 1e-40])
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        out = round_trip(t.to(dtype))
        assert out.dtype == dtype
        assert torch.equal(out.isnan(), t.to(dtype).isnan())
        assert raw_bytes(out) == raw_bytes(t.to(dtype))


def test_quantized_tensors_go_through_pickle():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        q = torch.quantize_per_tensor(torch.linspace(-1, 1, 12).reshape(3, 4), 0.05, 3, torch.qint8)
        out = round_trip(q)
        assert out.dtype == torch.qint8
        assert (out.q_scale(), out.q_zero_point()) == (q.q_scale(), q.q_zero_point())
        assert torch.equal(out.int_repr(), q.int_repr())
    with pytest.raises(EncodeError, match="allow_pickle=False"):
        encode(q, allow_pickle=False)


def test_requires_grad_is_detached_and_parameter_becomes_tensor():
    leaf = torch.randn(3, 2, requires_grad=True)
    non_leaf = leaf * 2
    out = round_trip([leaf, non_leaf, torch.nn.Parameter(torch.ones(2))], allow_pickle=False)
    assert_same(out, [leaf.detach(), non_leaf.detach(), torch.ones(2)])
    assert not any(t.requires_grad for t in out)


def test_lazy_conjugate_negative_and_expanded_views_are_resolved():
    z = torch.tensor([1 + 2j, 3 - 4j])
    assert z.conj().is_conj()
    value = {"conj": z.conj(), "neg": z.conj().imag, "expanded": torch.arange(3).expand(4, 3)}
    out = round_trip(value)
    assert torch.equal(out["conj"], torch.tensor([1 - 2j, 3 + 4j]))
    assert not out["conj"].is_conj()
    assert torch.equal(out["neg"], torch.tensor([-2.0, 4.0], dtype=torch.float32))
    assert torch.equal(out["expanded"], torch.arange(3).repeat(4, 1))


def test_meta_tensor_is_a_clear_error():
    with pytest.raises(EncodeError, match=r"obj\['m'\].*meta"):
        encode({"m": torch.empty(3, device="meta")})


# ------------------------------------------------------------------------------- numpy

NUMPY_DTYPES = ["<f8", ">f8", "<f2", "<i4", ">i4", "|u1", "<u8", "|b1", "<c8", ">c16", "<U5", "|S3",
                "<M8[ns]", "<m8[s]"]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_round_trip(dtype):
    base = np.frombuffer(np.random.default_rng(0).bytes(np.dtype(dtype).itemsize * 24), dtype=dtype)
    if np.dtype(dtype).kind == "b":
        base = base.view(np.uint8) % 2 == 1
    base = base.reshape(4, 6)
    zero_dim = base[1:2, 2:3].reshape(())
    cases = [base, base.T, base[::2, 1::3], base[1:], np.asfortranarray(base), zero_dim,
             base[:0], base[:, :0].T]
    for array in cases:
        out = round_trip({"a": array}, allow_pickle=False)["a"]
        assert type(out) is np.ndarray
        assert out.dtype.str == array.dtype.str
        assert out.shape == array.shape
        assert out.tobytes() == array.tobytes()


def test_numpy_scalars_round_trip_natively():
    values = [np.float32(1.5), np.float64(-0.25), np.int8(-3), np.uint64(2**64 - 1), np.bool_(True),
              np.complex64(1 - 2j), np.datetime64("2024-01-02T03:04:05", "ns"), np.str_("héllo")]
    out = round_trip(values, allow_pickle=False)
    for value, back in zip(values, out):
        assert type(back) is type(value)
        assert back.dtype == value.dtype
        assert back == value


def test_object_arrays_need_pickle():
    array = np.array([{"a": 1}, None], dtype=object)
    out = round_trip(array)
    assert out.dtype == object and out.tolist() == array.tolist()
    with pytest.raises(EncodeError, match="numpy.ndarray at obj"):
        encode(array, allow_pickle=False)


# ------------------------------------------------------------------------ python values


def test_nested_python_values_round_trip_with_exact_types():
    value = (
        [{"ids": torch.arange(5), "text": "naïve 中文 🚀", 7: None,
          -1: (True, 1, 1.0, b"\x00\xff")}],
        {"nested": ({"deep": [(), [], {}]},), "empty": "", "lone surrogate": "\ud800"},
        {(1, "a"): "tuple key", 2.5: "float key", None: "none key", b"k": "bytes key"},
        [0.0, -0.0, float("inf"), float("nan"), 1e308],
    )
    out = round_trip(value, allow_pickle=False)
    assert_same(out, value)
    assert type(out) is tuple and type(out[0][0][-1]) is tuple
    assert out[0][0][-1][0] is True and type(out[0][0][-1][1]) is int


@pytest.mark.parametrize(
    "number", [2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 2**1000, -(2**1000) + 1, 0]
)
def test_ints_beyond_64_bits_are_encoded_natively(number):
    out = round_trip({"n": number, "t": (number,)}, allow_pickle=False)
    assert out == {"n": number, "t": (number,)}
    assert type(out["n"]) is int


def test_long_bytes_and_str_go_out_of_band():
    blob = bytes(range(256)) * 1000
    text = "ünïcode " * (INLINE_LIMIT // 4)
    frames = encode({"blob": blob, "text": text, "short": "kept inline"})
    assert len(frames[0]) < 200
    assert len(frames) == 3
    assert address(frames[1]) == address(blob)  # bytes are not copied
    out = decode([bytes(f) for f in frames])
    assert out == {"blob": blob, "text": text, "short": "kept inline"}
    single = encode(blob)
    assert decode([single[0], blob]) is blob  # one whole bytes frame: returned as is


@dataclasses.dataclass
class Sample:
    prompt: str
    tokens: torch.Tensor
    mask: np.ndarray


Pair = collections.namedtuple("Pair", "left right")


def test_pickle_fallback_keeps_types_and_sends_tensors_out_of_band():
    tokens = torch.arange(250_000, dtype=torch.int32)
    sample = Sample("hi", tokens, np.ones(1000, dtype=bool))
    value = {
        "sample": sample,
        "ordered": collections.OrderedDict(b=1, a=2),
        "pair": Pair(1, torch.ones(2)),
        "set": {1, 2, 3},
        "frozen": frozenset({"x"}),
        "buffer": bytearray(b"abc" * 50_000),
        "empty buffer": bytearray(),
        "sparse": torch.eye(3).to_sparse(),
    }
    frames = encode(value)
    assert len(frames[0]) < 2000  # the 1 MB tensor and the bytearray are not in the header
    out = decode(frames)
    assert type(out["sample"]) is Sample and out["sample"].prompt == "hi"
    assert torch.equal(out["sample"].tokens, tokens)
    assert np.array_equal(out["sample"].mask, sample.mask)
    assert any(inside(out["sample"].tokens.data_ptr(), f) for f in frames[1:])  # zero copy
    assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"]) == ["b", "a"]
    assert type(out["pair"]) is Pair and torch.equal(out["pair"].right, torch.ones(2))
    assert out["set"] == {1, 2, 3} and out["frozen"] == frozenset({"x"})
    assert type(out["buffer"]) is bytearray and out["buffer"] == value["buffer"]
    assert type(out["empty buffer"]) is bytearray and out["empty buffer"] == bytearray()
    assert out["sparse"].is_sparse and torch.equal(out["sparse"].to_dense(), torch.eye(3))


def test_tensordict_round_trips_with_tensors_out_of_band():
    from tensordict import TensorDict

    td = TensorDict(
        {"ids": torch.arange(30_000).reshape(3, -1), "nested": {"mask": torch.ones(3, 2).bool()}},
        batch_size=[3],
    )
    frames = encode(td)
    assert len(frames[0]) < 1000
    assert address(frames[1]) == td["ids"].data_ptr()
    out = decode(frames)
    assert type(out) is TensorDict and out.batch_size == td.batch_size
    assert torch.equal(out["ids"], td["ids"])
    assert torch.equal(out["nested", "mask"], td["nested", "mask"])


def test_pickle_is_refused_on_decode_when_not_allowed():
    frames = encode({"s": {1, 2}})
    with pytest.raises(EncodeError, match=r"pickled set.*allow_pickle=False"):
        decode(frames, allow_pickle=False)
    assert decode(encode({"t": (1,)}), allow_pickle=False) == {"t": (1,)}


def test_depth_limit():
    ok: Any = 1
    for _ in range(MAX_DEPTH):
        ok = [ok]
    assert round_trip(ok) == ok
    with pytest.raises(EncodeError, match="nested more than"):
        encode([ok])


# ----------------------------------------------------------------------------- errors


def test_lambda_without_pickle_names_type_and_path():
    columns = {"chat": ["a", "b", "c", lambda: 1]}
    with pytest.raises(EncodeError) as info:
        encode(columns, allow_pickle=False, name="columns")
    message = str(info.value)
    assert "function" in message
    assert "columns['chat'][3]" in message
    assert "allow_pickle=True" in message


def test_lambda_with_pickle_names_type_and_path():
    columns = {"chat": ["a", "b", "c", lambda: 1]}
    with pytest.raises(EncodeError) as info:
        encode(columns, name="columns")
    message = str(info.value)
    assert "function" in message
    assert "columns['chat'][3]" in message
    assert "pickle failed" in message


@dataclasses.dataclass
class Holder:
    lock: Any


def test_unpicklable_object_nested_in_a_pickled_object():
    pattern = r"test_codec.Holder at obj\[1\]\[0\]\['h'\]: .*pickle failed.*lock"
    with pytest.raises(EncodeError, match=pattern):
        encode(([], [{"h": Holder(threading.Lock())}]))


def test_unencodable_dict_key_is_named():
    with pytest.raises(EncodeError, match=r"frozenset at obj\['a'\] \(the dict key frozenset"):
        encode({"a": {frozenset({1}): 1}}, allow_pickle=False)


@pytest.mark.parametrize("chunk_size", [0, -1, MAX_CHUNK + 1, 1.5, True])
def test_bad_chunk_size(chunk_size):
    with pytest.raises(InvalidArgument, match="chunk_size"):
        encode(1, chunk_size=chunk_size)


def test_header_longer_than_chunk_size_is_refused():
    with pytest.raises(EncodeError, match="header frame"):
        encode(["some text"] * 50, chunk_size=100)


def _good_frames() -> list[bytes]:
    return [bytes(f) for f in encode({"t": torch.arange(10.0), "u": torch.arange(3), "x": (1, 2)})]


def _header(body: Any, count: int = 1, version: int = 1, magic: str = "srl") -> bytes:
    return msgpack.packb([magic, version, count, msgpack.packb(body)])


def _ext(code: int, data: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(data))


def _one_ref(code: int, meta: list[Any]) -> list[bytes]:
    """Hand-made frames: a header holding one tensor/array ext, and a 4-byte frame."""
    return [_header(_ext(code, meta), count=2), b"abcd"]


CORRUPTIONS = {
    "no frames": (lambda f: [], "no frames"),
    "garbage header": (lambda f: [b"\xc1\x00garbage", *f[1:]], "cannot decode"),
    "truncated header": (lambda f: [f[0][:-3], *f[1:]], "cannot decode"),
    "missing frame": (lambda f: f[:-1], "announces 3 frames but 2"),
    "extra frame": (lambda f: [*f, b"x"], "announces 3 frames but 4"),
    "truncated frame": (lambda f: [f[0], f[1][:-1], f[2]], "has 39 bytes"),
    "swapped frames": (lambda f: [f[0], f[2], f[1]], "bytes, the header says"),
    "frame not bytes": (lambda f: [f[0], 12345, f[2]], "frame 1 is a int"),
    "wrong magic": (lambda f: [_header(None, magic="xyz")], "not a streamrl codec header"),
    "wrong version": (lambda f: [_header(None, version=99)], "version 99"),
    "unknown dtype": (lambda f: _one_ref(2, ["float99", [1], 1, 1, 4]), "float99"),
    "bad shape": (lambda f: _one_ref(2, ["int32", [-1], 1, 1, 4]), "bad shape"),
    "size mismatch": (lambda f: _one_ref(2, ["int32", [2], 1, 1, 4]), "cannot have 4"),
    "frame out of range": (lambda f: _one_ref(2, ["int32", [1], 5, 1, 4]), "refers to frames"),
    "quantized dtype": (lambda f: _one_ref(2, ["qint8", [4], 1, 1, 4]), "qint8"),
    "object ndarray": (lambda f: _one_ref(3, ["|O", [1], 1, 1, 4]), "raw bytes"),
    "unknown ext": (lambda f: [_header(_ext(42, None))], "unknown ext type 42"),
    "bad pickle": (lambda f: [_header(_ext(8, ["thing", b"junk", []]))], "unpickling a thing"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_frames_raise_encode_error(corruption):
    corrupt, pattern = CORRUPTIONS[corruption]
    frames = _good_frames()
    assert len(frames) == 3 and len(frames[1]) == 40
    assert_same(decode(frames)["x"], (1, 2))
    with pytest.raises(EncodeError, match=pattern):
        decode(corrupt(frames))


def test_decode_of_one_buffer_points_to_unpack():
    with pytest.raises(EncodeError, match="unpack"):
        decode(pack(encode(1)))


# ------------------------------------------------------------------------------- chunks


def test_chunked_tensor_frames_stay_under_chunk_size():
    tensor = torch.arange(2500, dtype=torch.int32)  # 10_000 bytes
    frames = encode({"t": tensor}, chunk_size=1000)
    assert len(frames) == 11
    assert all(memoryview(f).nbytes <= 1000 for f in frames)
    assert [address(f) for f in frames[1:]] == [tensor.data_ptr() + i * 1000 for i in range(10)]
    out = decode([bytes(f) for f in frames])["t"]
    assert torch.equal(out, tensor)
    assert not any(inside(out.data_ptr(), f) for f in frames)  # joined: new memory


def test_chunked_uneven_sizes_and_numpy():
    values = {"t": torch.arange(10_001, dtype=torch.uint8), "a": np.arange(1001, dtype=np.float64),
              "b": bytes(2500), "s": "x" * (INLINE_LIMIT + 1)}
    frames = encode(values, chunk_size=1000)
    sizes = [memoryview(f).nbytes for f in frames[1:]]
    assert sizes[:11] == [1000] * 10 + [1]
    assert max(memoryview(f).nbytes for f in frames) <= 1000
    assert_same(decode(frames), values)


@settings(max_examples=60, deadline=None)
@given(nbytes=st.integers(0, 3000), chunk_size=st.integers(128, 700), seed=st.integers(0, 2**32))
def test_chunking_property(nbytes, chunk_size, seed):
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    value = [torch.from_numpy(data.copy()), data, data.tobytes()]
    frames = encode(value, chunk_size=chunk_size)
    assert all(memoryview(f).nbytes <= chunk_size for f in frames)
    assert frames_nbytes(frames) >= 3 * nbytes
    assert_same(decode(frames), value)


# ----------------------------------------------------------------------------- zero copy


def test_encoded_frame_shares_memory_with_contiguous_tensor():
    tensor = torch.arange(100, dtype=torch.float32)
    frames = encode({"t": tensor})
    assert len(frames) == 2 and isinstance(frames[1], memoryview)
    assert address(frames[1]) == tensor.data_ptr()
    tensor[0] = 42.0
    assert np.frombuffer(frames[1], dtype=np.float32)[0] == 42.0


def test_storage_offset_is_zero_copy_and_non_contiguous_is_copied():
    base = torch.arange(10, dtype=torch.float32)
    frames = encode([base[3:7], base.reshape(2, 5).T])
    assert address(frames[1]) == base.data_ptr() + 3 * 4
    assert not inside(address(frames[2]), memoryview(base.numpy()))
    expected = base.reshape(2, 5).T.reshape(-1).tolist()
    assert np.frombuffer(frames[2], dtype=np.float32).tolist() == expected


def test_encoded_frame_shares_memory_with_numpy_array():
    array = np.arange(50, dtype=np.int64)
    frames = encode(array)
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), array)


def test_decoded_tensor_is_a_view_of_its_frame():
    frames = [bytearray(f) for f in encode({"t": torch.arange(8, dtype=torch.int64)})]
    out = decode(frames)["t"]
    assert inside(out.data_ptr(), frames[1])
    out[0] = 99  # writes through into the frame
    assert np.frombuffer(frames[1], dtype=np.int64)[0] == 99


def test_decoded_tensor_from_readonly_bytes_and_numpy_frames():
    frames = [bytes(f) for f in encode([torch.arange(8.0), np.arange(4.0)])]
    tensor, array = decode(frames)
    assert inside(tensor.data_ptr(), frames[1])
    assert np.shares_memory(array, np.frombuffer(frames[2], dtype=np.uint8))
    assert not array.flags.writeable  # numpy enforces read-only frames
    as_arrays = [np.frombuffer(f, dtype=np.uint8) for f in frames]
    tensor2, array2 = decode(as_arrays)
    assert inside(tensor2.data_ptr(), as_arrays[1]) and torch.equal(tensor2, torch.arange(8.0))
    assert np.array_equal(array2, np.arange(4.0))


def test_unaligned_frame_is_copied_to_aligned_memory():
    header, payload = encode(torch.arange(4, dtype=torch.float64))
    backing = bytearray(len(payload) + 1)
    backing[1:] = payload
    frame = memoryview(backing)[1:]
    assert address(frame) % 8 != 0
    out = decode([header, frame])
    assert out.data_ptr() % 8 == 0 and torch.equal(out, torch.arange(4, dtype=torch.float64))


@pytest.fixture
def torch_warns_always():
    """Make torch repeat its warn-once warnings (the read-only buffer one among them)."""
    before = torch._C._get_warnAlways()
    torch._C._set_warnAlways(True)
    yield
    torch._C._set_warnAlways(before)


def test_decoding_readonly_frames_emits_no_warning(torch_warns_always):
    frames = [bytes(f) for f in encode(torch.arange(3))]
    with pytest.warns(UserWarning, match="not writable"):  # the warning the codec silences
        torch.frombuffer(frames[1], dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode(frames).tolist() == [0, 1, 2]


# -------------------------------------------------------------------------- pack/unpack


def test_pack_unpack_round_trip():
    value = {"t": torch.arange(1000, dtype=torch.int16), "a": np.ones((3, 3)), "x": ("y", None)}
    frames = encode(value, chunk_size=700)
    data = pack(frames)
    assert len(data) >= frames_nbytes(frames)
    assert frames_nbytes(frames) == sum(len(bytes(f)) for f in frames)
    parts = unpack(data)
    assert [bytes(p) for p in parts] == [bytes(f) for f in frames]
    assert all((address(p) - address(data)) % 64 == 0 for p in parts if p.nbytes)
    assert_same(decode(parts), value)
    assert unpack(pack([])) == []


@pytest.mark.parametrize(
    "corrupt, pattern",
    [
        (lambda d: d[:5], "too short"),
        (lambda d: b"XXXX" + d[4:], "not made by"),
        (lambda d: d[:-1], "truncated"),
        (lambda d: d + b"\x00", "follow the last frame"),
        (lambda d: d[:4] + (10**6).to_bytes(4, "little") + d[8:], "not made by"),
    ],
)
def test_unpack_rejects_corrupt_buffers(corrupt, pattern):
    data = pack(encode(torch.arange(5)))
    assert len(unpack(data)) == 2
    with pytest.raises(EncodeError, match=pattern):
        unpack(corrupt(data))


# ----------------------------------------------------------------------------- property

_HYP_DTYPES = [torch.float32, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bfloat16,
               torch.float16, torch.bool, torch.complex64, torch.uint32]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_HYP_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    size = math.prod(shape) * dtype.itemsize
    data = draw(st.binary(min_size=size, max_size=size))
    if dtype is torch.bool:
        data = bytes(b & 1 for b in data)
    if size:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
    else:
        t = torch.empty(shape, dtype=dtype)
    view = draw(st.sampled_from(["as is", "transpose", "step", "offset"]))
    if view == "transpose" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif view == "step" and t.dim() >= 1:
        t = t[::2]
    elif view == "offset" and t.dim() >= 1:
        t = t[1:]
    return t


arrays = hnp.arrays(
    dtype=st.sampled_from([np.dtype(d) for d in ["<f8", ">i4", "|b1", "<u2", "<c8"]]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
)

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text()
    | st.binary()
    | tensors()
    | arrays
)
keys = (
    st.text(max_size=5)
    | st.integers(-(2**63), 2**64 - 1)
    | st.tuples(st.integers(), st.text(max_size=3))
)
structures = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=4)
    | st.lists(children, max_size=4).map(tuple)
    | st.dictionaries(keys, children, max_size=4),
    max_leaves=15,
)


@settings(max_examples=150, deadline=None)
@given(
    value=structures,
    transport=st.sampled_from(["frames", "bytes", "bytearray", "numpy", "pack"]),
)
def test_random_structures_round_trip(value, transport):
    frames = encode({"value": value}, allow_pickle=False)
    if transport == "bytes":
        frames = [bytes(f) for f in frames]
    elif transport == "bytearray":
        frames = [bytearray(f) for f in frames]
    elif transport == "numpy":
        frames = [np.frombuffer(bytes(f), dtype=np.uint8) for f in frames]
    elif transport == "pack":
        frames = unpack(pack(frames))
    assert_same(decode(frames)["value"], value)


def test_default_chunk_is_one_gib():
    assert DEFAULT_CHUNK == 1 << 30 < MAX_CHUNK
