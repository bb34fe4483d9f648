"""The HTTP tensor codec and request validation for the Serve endpoint (no Ray, no FastAPI).

Wire format of one tensor, exactly one of `data` / `b64`:

    {"shape": [1, 256, 2, 32], "dtype": "float32", "data": [...]}   # numbers, flat or nested to shape
    {"shape": [1, 256, 2, 32], "dtype": "bfloat16", "b64": "..."}   # base64 of raw little-endian bytes
    {"shape": [1, 64], "dtype": "int64", "data": [...]}              # integers only (e.g. token ids)

A request body is `{"inputs": {name: tensor, ...}}` (tensors are not accepted at the top level, so a
tensor named like a request option can never be confused with one). `bfloat16` b64 is 2 bytes per
element (the upper half of the float32 bits); `bfloat16` data are numbers rounded to bfloat16.
JSON `NaN` / `Infinity` literals, and numbers that overflow the dtype, count as non-finite values.

Every bad request raises `RequestError(field, message, status)`: `field` is a dotted path such as
`inputs.x.shape`, the message says what was received and what is allowed. What a request must hold
is the workload's `request_specs(preset)` (`evo.workloads.requests.TensorSpec`, one per input).
"""
from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any, Iterable, Mapping

import numpy as np
import torch

# The schema a workload declares (request_specs) and the rules a request's tensors are checked by, which
# the registered pyfunc applies too: they live with the schema, below serving and evidence.
from evo.workloads.requests import (RequestError, TensorSpec, _check_names, _check_shape, _check_values,  # noqa: F401
                                    _dtype_name, check_tensors, request_schema)

# dtype name -> (torch dtype, little-endian numpy dtype of the raw b64 bytes)
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "<f4"),
    "bfloat16": (torch.bfloat16, "<i2"),  # raw bf16 bits, reinterpreted after the copy
    "float64": (torch.float64, "<f8"),
    "int64": (torch.int64, "<i8"),  # e.g. token ids; `data` must then hold JSON integers
}
INTEGER_DTYPES = frozenset({"int64"})
ENCODINGS = ("data", "b64")
_TENSOR_KEYS = ("shape", "dtype", "data", "b64")
_NUMBER_TYPES = frozenset({int, float})  # bool is excluded on purpose: type(True) is bool


# ---------------------------------------------------------------------------------------------
# request level


TENSOR_BODY = '{"inputs": {name: tensor, ...}}'  # what the tensor API expects: named in its errors


def parse_body(body: bytes | bytearray | memoryview | str | dict, *, max_bytes: int, expected: str = TENSOR_BODY
               ) -> dict:
    """Raw body -> JSON object. Over `max_bytes` -> 413; malformed JSON -> 400; not an object -> 422. The errors
    name `expected`, the body the route takes (the tensor API's by default).

    A dict is taken as already parsed (its size is not checked).
    """
    if isinstance(body, dict):
        return body
    if isinstance(body, str):
        body = body.encode("utf-8")
    size = len(body)
    if size > max_bytes:
        raise RequestError("body", f"request body is {size} bytes; the limit is {max_bytes} bytes "
                                   f"(send fewer or smaller tensors, or use \"b64\" encoding)", 413)
    try:
        # bytes and bytearray parse in place (no copy of a body that may be max_bytes long)
        # NaN / Infinity literals parse to float; checked per tensor
        obj = json.loads(body if isinstance(body, (bytes, bytearray)) else bytes(body))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError("body", f"malformed JSON ({e}); expected an object {expected}", 400) from None
    if not isinstance(obj, dict):
        raise RequestError("body", f"received a JSON {_json_type(obj)}; expected an object {expected}")
    return obj


def decode_request(body: bytes | str | dict, specs: Iterable[TensorSpec], *, max_bytes: int,
                   max_elements: int | None = None, extra_keys: Iterable[str] = (),
                   consume: bool = False, axes: Mapping[str, tuple[int, int]] | None = None
                   ) -> dict[str, torch.Tensor]:
    """Validate and decode `{"inputs": {...}}` against `specs` -> {name: CPU tensor of its declared dtype}.

    Absent (or null) optional tensors are left out of the result. `axes` bounds free dims by symbol,
    inclusive (e.g. {"B": (1, 8), "T": (1, 2048)}: the workload's verified domain); a dim outside is
    422 naming the bound. `max_elements` bounds the total element count of all tensors (413).
    Top-level keys other than "inputs" are rejected unless listed in
    `extra_keys` (e.g. a response "encoding" the endpoint reads itself from `parse_body`'s result).
    With `consume`, each tensor's JSON is removed from `body["inputs"]` once decoded, so a server holds
    one form of each tensor at a time, not its JSON lists and its tensor side by side.
    """
    specs = tuple(specs)
    obj = parse_body(body, max_bytes=max_bytes)
    allowed_top = ("inputs", *extra_keys)
    for key in obj:
        if key not in allowed_top:
            raise RequestError(str(key), f"unknown top-level key {key!r}; allowed: {list(allowed_top)}")
    if "inputs" not in obj:
        raise RequestError("inputs", f"missing; received top-level keys {list(obj)}, expected "
                                     f"{{\"inputs\": {{name: tensor, ...}}}}")
    inputs = obj["inputs"]
    if not isinstance(inputs, dict):
        raise RequestError("inputs", f"received a JSON {_json_type(inputs)}; expected an object "
                                     f"{{name: tensor, ...}} with names {[s.name for s in specs]}")
    _check_names(inputs, specs)
    bindings: dict[str, tuple[int, str]] = {}  # symbol -> (value, field that bound it)
    total, out = 0, {}
    for spec in specs:
        entry = inputs.get(spec.name)
        if entry is None:
            continue  # absent optional (required ones were checked by _check_names)
        field = f"inputs.{spec.name}"
        header = _read_header(entry, field, spec.dtypes)
        total += math.prod(header[0])
        if max_elements is not None and total > max_elements:
            raise RequestError(f"{field}.shape", f"shape {list(header[0])} brings the request to {total} "
                                                 f"elements; the limit is {max_elements}", 413)
        _check_shape(header[0], spec, field, bindings, axes or {})
        t = _decode_payload(entry, field, *header)
        payload = "data" if "data" in entry else "b64"
        if consume:
            del inputs[spec.name], entry  # its JSON lists (or base64 text) can be freed now
        _check_values(t, spec, f"{field}.{payload}")
        out[spec.name] = t
    return out


# ---------------------------------------------------------------------------------------------
# tensor level


def decode_tensor(obj: Any, field: str = "tensor", *, dtypes: Iterable[str] = tuple(DTYPES),
                  allow_nonfinite: bool = True) -> torch.Tensor:
    """One wire tensor -> CPU tensor of its dtype (used by clients and tests; the server uses decode_request)."""
    header = _read_header(obj, field, tuple(dtypes))
    t = _decode_payload(obj, field, *header)
    if not allow_nonfinite:
        _check_values(t, TensorSpec(field, (), ()), f"{field}.{'data' if 'data' in obj else 'b64'}")
    return t


def encode_tensor(t: torch.Tensor, encoding: str = "data") -> dict:
    """CPU or device tensor -> wire dict. "b64" is bit-exact; "data" is nested lists (exact for these dtypes)."""
    name = _dtype_name(t.dtype)
    if name not in DTYPES:
        raise ValueError(f"cannot encode dtype {t.dtype}; allowed: {list(DTYPES)}")
    t = t.detach().to("cpu").contiguous()
    out: dict[str, Any] = {"shape": list(t.shape), "dtype": name}
    if encoding == "data":
        out["data"] = (t.float() if t.dtype == torch.bfloat16 else t).tolist()  # bf16 -> f32 is exact
    elif encoding == "b64":
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        out["b64"] = base64.b64encode(raw.numpy().astype(DTYPES[name][1], copy=False).tobytes()).decode("ascii")
    else:
        raise RequestError("encoding", f"received {encoding!r}; allowed: {list(ENCODINGS)}")
    return out


def encode_outputs(outputs: Mapping[str, torch.Tensor], encoding: str) -> dict:
    """{name: tensor} -> {"outputs": {name: wire tensor}}."""
    if encoding not in ENCODINGS:
        raise RequestError("encoding", f"received {encoding!r}; allowed: {list(ENCODINGS)}")
    return {"outputs": {name: encode_tensor(t, encoding) for name, t in outputs.items()}}


def _read_header(obj: Any, field: str, dtypes: tuple[str, ...]) -> tuple[tuple[int, ...], str]:
    """Check the tensor object's keys, dtype and shape -> (shape, dtype name)."""
    if not isinstance(obj, dict):
        raise RequestError(field, f"received a JSON {_json_type(obj)}; expected a tensor object "
                                  f"{{\"shape\": [...], \"dtype\": ..., \"data\" or \"b64\": ...}}")
    extra = [k for k in obj if k not in _TENSOR_KEYS]
    if extra:
        raise RequestError(field, f"unknown key(s) {extra}; allowed: {list(_TENSOR_KEYS)}")
    missing = [k for k in ("shape", "dtype") if k not in obj]
    if missing:
        raise RequestError(field, f"missing key(s) {missing}; received {list(obj)}; a tensor needs "
                                  f"\"shape\", \"dtype\" and exactly one of \"data\" / \"b64\"")
    payload = [k for k in ("data", "b64") if k in obj]
    if len(payload) != 1:
        raise RequestError(field, f"received {'both' if payload else 'neither'} of \"data\" and \"b64\"; "
                                  f"send exactly one")
    dtype = obj["dtype"]
    if not isinstance(dtype, str) or dtype not in dtypes:
        raise RequestError(f"{field}.dtype", f"received {_short(dtype)}; allowed: {list(dtypes)}")
    shape = obj["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise RequestError(f"{field}.shape", f"received {_short(shape)}; expected a list of non-negative ints "
                                             f"(a free dim's verified range is checked against the schema)")
    return tuple(shape), dtype


def _decode_payload(obj: dict, field: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    if "b64" in obj:
        return _decode_b64(obj["b64"], f"{field}.b64", shape, dtype)
    return _decode_data(obj["data"], f"{field}.data", shape, dtype)


def _decode_b64(s: Any, field: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    torch_dtype, np_dtype = DTYPES[dtype]
    if not isinstance(s, str):
        raise RequestError(field, f"received a JSON {_json_type(s)}; expected a base64 string")
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(field, f"malformed base64 ({e}); expected standard base64 (A-Z a-z 0-9 + /, "
                                  f"'=' padding) of raw little-endian bytes") from None
    n, itemsize = math.prod(shape), np.dtype(np_dtype).itemsize
    if len(raw) != n * itemsize:
        raise RequestError(field, f"decoded to {len(raw)} bytes; shape {list(shape)} of {dtype} needs "
                                  f"{n} x {itemsize} = {n * itemsize} bytes")
    arr = np.frombuffer(raw, dtype=np_dtype).astype(np.dtype(np_dtype).newbyteorder("="))  # owned, native
    t = torch.from_numpy(arr).reshape(shape)
    return t.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else t


def _decode_data(data: Any, field: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    if not shape and type(data) in _NUMBER_TYPES:
        data = [data]  # a rank-0 tensor may be sent as a bare number
    if not isinstance(data, list):
        raise RequestError(field, f"received a JSON {_json_type(data)}; expected a list of numbers, flat "
                                  f"({math.prod(shape)}) or nested to shape {list(shape)}")
    nested = len(shape) > 1 and len(data) > 0 and isinstance(data[0], list)
    if nested:
        _check_nested(data, shape, field)
    else:
        _check_flat(data, shape, field)
    if dtype in INTEGER_DTYPES:
        return _integers(data, field, shape, dtype)
    # Straight to the dtype, one rounding step from the parsed float64 values (overflow becomes inf);
    # bfloat16, which numpy lacks, goes through float64 so it is rounded once, to nearest even.
    direct = {"float32": np.float32, "float64": np.float64}.get(dtype, np.float64)
    try:
        with np.errstate(over="ignore"):
            arr = np.array(data, dtype=direct)
    except OverflowError:
        raise RequestError(field, "an integer is too large to convert to a float; send floats "
                                  "within the dtype's range") from None
    t = torch.from_numpy(arr).reshape(shape)
    return t if dtype in ("float32", "float64") else t.to(DTYPES[dtype][0])


def _integers(data: list, field: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """Nested or flat JSON integers -> an integer tensor; a float (even 3.0) or an out-of-range integer is refused."""
    flat = np.array(data, dtype=object).reshape(-1).tolist()
    j = next((j for j, x in enumerate(flat) if type(x) is not int), None)
    if j is not None:
        raise RequestError(field, f"value {_short(flat[j])} at flat index {j} is not an integer; {dtype} data "
                                  f"must be JSON integers")
    native = np.dtype(DTYPES[dtype][1]).newbyteorder("=")
    try:
        arr = np.array(flat, dtype=native)
    except OverflowError:
        info = np.iinfo(native)
        raise RequestError(field, f"an integer is out of the range of {dtype} [{info.min}, {info.max}]") from None
    return torch.from_numpy(arr).reshape(shape)


def _check_flat(data: list, shape: tuple[int, ...], field: str) -> None:
    n = math.prod(shape)
    if len(data) != n:
        raise RequestError(field, f"received {len(data)} values; shape {list(shape)} needs {n} "
                                  f"(flat) or a list nested to that shape")
    _check_numbers(data, field)


def _check_nested(data: list, shape: tuple[int, ...], field: str) -> None:
    """Walk level by level: each list at depth d must have shape[d] entries; leaves must be numbers."""
    level = [data]
    for depth, size in enumerate(shape):
        last = depth == len(shape) - 1
        nxt: list = []
        for i, row in enumerate(level):
            if type(row) is not list:
                raise RequestError(field, f"at data{_index(i, shape[:depth])}: received {_short(row)}; expected "
                                          f"a list of {size} {'numbers' if last else 'lists'} (shape {list(shape)})")
            if len(row) != size:
                raise RequestError(field, f"ragged data: data{_index(i, shape[:depth])} has {len(row)} entries; "
                                          f"shape {list(shape)} needs {size} at depth {depth}")
            if last:
                _check_numbers(row, field, lambda: _index(i, shape[:depth]))
            else:
                nxt.extend(row)
        level = nxt


def _check_numbers(row: list, field: str, prefix=lambda: "") -> None:
    """Every entry a JSON number (int or float, not bool); `prefix()` gives the row's index for the message."""
    if set(map(type, row)) <= _NUMBER_TYPES:  # C-speed type scan; the common case ends here
        return
    j = next(j for j, x in enumerate(row) if type(x) not in _NUMBER_TYPES)
    raise RequestError(field, f"at data{prefix()}[{j}]: received {_short(row[j])} ({_json_type(row[j])}); "
                              f"expected a number")


def _index(i: int, dims: tuple[int, ...]) -> str:
    return "".join(f"[{int(k)}]" for k in np.unravel_index(i, dims)) if dims else ""


def _json_type(x: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
             int: "number", float: "number"}
    return names.get(type(x), type(x).__name__)


def _short(x: Any, limit: int = 60) -> str:
    s = repr(x)
    return s if len(s) <= limit else s[: limit - 3] + "..."
