"""On-disk format of one Engram table: a directory with ``manifest.json`` (written last: version, geometry, file
sizes, a CRC32 per chunk of each file, the layout fingerprint), ``values.bin``, ``scales.bin`` and
``values.crc32c``; every defect raises ``TableFormatError`` naming file and byte offset. Format 1 (no page
CRCs) opens on the gpu and host tiers only::

    values.bin   | row 0 | row 1 | ... | row 15 | row 16 | ...          fixed row_stride bytes per row
                 |<------------- page 0 (4096 B) ------>|<- page 1 ...  row r at byte r * row_stride
                 (no row straddles two pages; zero-padded to a whole page)
    scales.bin   | 8 B row 0 | 8 B row 1 | ...                         (mxfp8 only) dim/32 E8M0 bytes/row
    values.crc32c| crc page 0 | crc page 1 | ...                       (format 2) uint32 LE CRC32C per page"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

FORMAT_NAME = "engram-table"
FORMAT_VERSION = 2  # 2: values.crc32c, the per-page CRC32C sidecar
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
VALUES_FILE = "values.bin"
SCALES_FILE = "scales.bin"
PAGE_CRC_FILE = "values.crc32c"
PAGE_CRC_BYTES = 4  # one little-endian uint32 CRC32C per page of values.bin
PAGE_SIZE = 4096
SCALE_BLOCK = 32
DEFAULT_CHUNK_BYTES = 64 << 20
ITEMSIZE = {"mxfp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


class TableFormatError(ValueError):
    """A table directory that cannot be used: ``file`` and byte ``offset`` say where, ``why`` says what."""

    def __init__(self, file: str | os.PathLike, offset: int, why: str) -> None:
        self.file, self.offset, self.why = str(file), int(offset), why
        super().__init__(f"{self.file}: byte {self.offset}: {why}")


def row_stride(value_bytes: int, page_size: int = PAGE_SIZE) -> int:
    """Bytes per row in values.bin: the smallest power of two >= value_bytes when it fits in a page, else value_bytes
    rounded up to whole pages."""
    if value_bytes < 1:
        raise ValueError(f"value_bytes={value_bytes} must be >= 1")
    if value_bytes > page_size:
        return -(-value_bytes // page_size) * page_size
    return 1 << (value_bytes - 1).bit_length()


def values_file_bytes(rows: int, stride: int, page_size: int = PAGE_SIZE) -> int:
    """Size of values.bin: rows * stride, zero-padded to whole pages."""
    return -(-rows * stride // page_size) * page_size


@dataclass
class FileEntry:
    """One data file of a table: its name in the directory, exact size and CRC32 of each chunk."""

    name: str  # file name inside the table directory
    bytes: int  # exact file size
    crc32: list[int] = field(default_factory=list)  # one per chunk_bytes chunk, the last may be short


@dataclass
class TableManifest:
    """Parsed manifest.json of a table directory (``path``); see the module docstring for the layout."""

    path: Path  # the table directory
    rows: int  # rows in the table
    dim: int  # values per row
    row_dtype: str  # mxfp8 | bf16 | fp16 | fp32
    row_stride: int  # bytes per row in values.bin (power of two dividing page_size, or whole pages)
    files: dict[str, FileEntry]  # "values", for mxfp8 "scales", from format 2 "page_crc" (the sidecar)
    layer_id: int | None = None  # Engram layer the table belongs to, if any
    fingerprint: dict[str, Any] | None = None  # EngramConfig.fingerprint(layer_id) at write time
    meta: dict[str, Any] = field(default_factory=dict)  # free-form (source, seed, ...)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # checksum chunk size
    page_size: int = PAGE_SIZE  # alignment unit of values.bin
    scale_block: int = SCALE_BLOCK  # values per MXFP8 scale
    format_version: int = FORMAT_VERSION

    @property
    def value_bytes(self) -> int:
        """Bytes of one row's values (row_stride minus padding)."""
        return self.dim * ITEMSIZE[self.row_dtype]

    @property
    def scale_cols(self) -> int:
        """Scale bytes per row: dim / 32 for mxfp8, else 0."""
        return self.dim // self.scale_block if self.row_dtype == "mxfp8" else 0

    @property
    def values_path(self) -> Path:
        return self.path / self.files["values"].name

    @property
    def pages(self) -> int:
        """Pages of values.bin (it is zero-padded to whole pages)."""
        return self.files["values"].bytes // self.page_size

    @property
    def has_page_crcs(self) -> bool:
        """Whether the table has the per-page CRC32C sidecar (format 2)."""
        return "page_crc" in self.files

    def to_json(self) -> str:
        csum = {"algorithm": "crc32", "chunk_bytes": self.chunk_bytes}
        if self.has_page_crcs:
            csum["pages"] = "crc32c"
        doc = {
            "format": FORMAT_NAME, "format_version": self.format_version, "layer_id": self.layer_id,
            "rows": self.rows, "dim": self.dim, "row_dtype": self.row_dtype, "scale_block": self.scale_block,
            "page_size": self.page_size, "value_bytes": self.value_bytes, "row_stride": self.row_stride,
            "scale_cols": self.scale_cols,
            "checksum": csum,
            "files": {k: {"name": f.name, "bytes": f.bytes, "crc32": f.crc32} for k, f in self.files.items()},
            "fingerprint": self.fingerprint, "meta": self.meta,
        }
        return json.dumps(doc, indent=1) + "\n"


def _key_offset(text: str, key: str) -> int:
    """Byte offset of ``"key"`` in the manifest text (0 when absent), so errors point into the file."""
    pos = text.find(f'"{key}"')
    return len(text[:pos].encode()) if pos >= 0 else 0


def read_manifest(directory: str | os.PathLike, check_sizes: bool = True) -> TableManifest:
    """Parse and validate ``directory/manifest.json`` (and the data file sizes when ``check_sizes``)."""
    root = Path(directory)
    mpath = root / MANIFEST
    if not root.is_dir():
        raise TableFormatError(root, 0, "not a table directory (missing or not a directory)")
    if not mpath.is_file():
        raise TableFormatError(mpath, 0, "missing: the table was not completely written (the manifest is "
                                         "written last) or this is not a table directory")
    raw = mpath.read_bytes()
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text)
    except UnicodeDecodeError as e:
        raise TableFormatError(mpath, e.start, f"not UTF-8: {e.reason}") from None
    except json.JSONDecodeError as e:
        raise TableFormatError(mpath, len(text[:e.pos].encode()), f"invalid JSON: {e.msg}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise TableFormatError(mpath, _key_offset(text, "format"), f"not an {FORMAT_NAME} manifest")

    def get(key: str, kind: type | tuple[type, ...], container: dict | None = None, ok=lambda v: True,
            rule: str = "") -> Any:
        src = doc if container is None else container
        if key not in src:
            raise TableFormatError(mpath, 0, f"field {key!r} is missing")
        v = src[key]
        if isinstance(v, bool) or not isinstance(v, kind) or not ok(v):
            raise TableFormatError(mpath, _key_offset(text, key), f"field {key!r}={v!r} is invalid{rule}")
        return v

    version = get("format_version", int)
    if version not in READABLE_VERSIONS:
        raise TableFormatError(mpath, _key_offset(text, "format_version"),
                               f"format_version {version} is not supported "
                               f"(this build reads {list(READABLE_VERSIONS)})")
    row_dtype = get("row_dtype", str, ok=lambda v: v in ITEMSIZE, rule=f" (one of {sorted(ITEMSIZE)})")
    rows = get("rows", int, ok=lambda v: v >= 1, rule=" (>= 1)")
    page = get("page_size", int, ok=lambda v: v >= 512 and v & (v - 1) == 0, rule=" (a power of two >= 512)")
    block = get("scale_block", int, ok=lambda v: v == SCALE_BLOCK, rule=f" (must be {SCALE_BLOCK})")
    dim = get("dim", int, ok=lambda v: v >= 1 and (row_dtype != "mxfp8" or v % block == 0),
              rule=f" (>= 1, a multiple of {SCALE_BLOCK} for mxfp8)")
    stride = get("row_stride", int, ok=lambda v: v == row_stride(dim * ITEMSIZE[row_dtype], page),
                 rule=f" (expected {row_stride(dim * ITEMSIZE[row_dtype], page)} for {dim} {row_dtype} values)")
    csum = get("checksum", dict)
    get("algorithm", str, csum, ok=lambda v: v == "crc32", rule=" (must be 'crc32')")
    chunk = get("chunk_bytes", int, csum, ok=lambda v: v >= PAGE_SIZE and v % PAGE_SIZE == 0,
                rule=f" (a positive multiple of {PAGE_SIZE})")
    layer_id = doc.get("layer_id")
    if layer_id is not None and (isinstance(layer_id, bool) or not isinstance(layer_id, int)):
        raise TableFormatError(mpath, _key_offset(text, "layer_id"), f"field 'layer_id'={layer_id!r} is invalid")
    fingerprint = doc.get("fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, dict):
        raise TableFormatError(mpath, _key_offset(text, "fingerprint"), "field 'fingerprint' must be an object")
    files_doc = get("files", dict)
    needed = {"values": values_file_bytes(rows, stride, page)}
    if row_dtype == "mxfp8":
        needed["scales"] = rows * (dim // block)
    if version >= 2:
        get("pages", str, csum, ok=lambda v: v == "crc32c", rule=" (must be 'crc32c')")
        if chunk % page:
            raise TableFormatError(mpath, _key_offset(text, "chunk_bytes"),
                                   f"field 'chunk_bytes'={chunk} is invalid (a multiple of page_size {page})")
        needed["page_crc"] = needed["values"] // page * PAGE_CRC_BYTES
    files: dict[str, FileEntry] = {}
    for kind, size in needed.items():
        entry = get(kind, dict, files_doc)
        name = get("name", str, entry, ok=lambda v: v and "/" not in v and v not in (".", ".."),
                   rule=" (a plain file name)")
        nbytes = get("bytes", int, entry, ok=lambda v, s=size: v == s,
                     rule=f" (a {rows}-row {row_dtype} table needs {size} bytes in {kind})")
        crcs = get("crc32", list, entry, ok=lambda v, s=size: len(v) == max(1, -(-s // chunk)),
                   rule=f" (needs one CRC per {chunk}-byte chunk)")
        files[kind] = FileEntry(name, nbytes, [int(c) for c in crcs])
    m = TableManifest(path=root, rows=rows, dim=dim, row_dtype=row_dtype, row_stride=stride, files=files,
                      layer_id=layer_id, fingerprint=fingerprint, meta=doc.get("meta") or {}, chunk_bytes=chunk,
                      page_size=page, scale_block=block, format_version=version)
    if check_sizes:
        for entry in files.values():
            check_file_size(root / entry.name, entry.bytes)
    return m


def check_file_size(path: Path, expected: int) -> None:
    """TableFormatError at the first missing (truncated) or extra byte of a data file."""
    if not path.is_file():
        raise TableFormatError(path, 0, f"data file is missing (expected {expected} bytes)")
    actual = path.stat().st_size
    if actual < expected:
        raise TableFormatError(path, actual, f"truncated: {actual} bytes, the manifest says {expected}")
    if actual > expected:
        raise TableFormatError(path, expected, f"too long: {actual} bytes, the manifest says {expected}")


def checksum_error(path: Path, index: int, offset: int, nbytes: int) -> TableFormatError:
    """The error for chunk ``index`` (``nbytes`` at byte ``offset`` of ``path``) failing its CRC32."""
    return TableFormatError(path, offset, f"checksum mismatch in chunk {index} (bytes {offset}..{offset + nbytes - 1})")


def check_fingerprint(m: TableManifest, expect: dict[str, Any]) -> None:
    """Refuse a table built for another layout: every key of ``expect`` (EngramConfig.fingerprint) must match; a table
    without a fingerprint must match rows, dim and layer."""
    mpath = m.path / MANIFEST
    text = mpath.read_text(encoding="utf-8")
    if m.fingerprint is None:
        have = {"rows": m.rows, "head_dim": m.dim, "layer_id": m.layer_id}
        for key in ("rows", "head_dim", "layer_id"):
            if key in expect and have[key] is not None and expect[key] != have[key]:
                raise TableFormatError(mpath, _key_offset(text, "rows" if key == "rows" else "dim"),
                                       f"layout mismatch: table has {key}={have[key]}, expected {expect[key]}")
        return
    for key, want in expect.items():
        got = m.fingerprint.get(key)
        if got != want:
            short = lambda v: (str(v)[:120] + "...") if len(str(v)) > 120 else str(v)  # noqa: E731
            raise TableFormatError(mpath, _key_offset(text, "fingerprint"),
                                   f"layout fingerprint mismatch on {key!r}: table was built for {short(got)}, "
                                   f"expected {short(want)} (a table of another layout or layer)")


class ChunkCrc:
    """CRC32 per fixed-size chunk of a byte stream fed in pieces of any size."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.crcs: list[int] = []
        self._crc = 0
        self._fill = 0  # bytes of the current chunk seen so far

    def update(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        pos = 0
        while pos < len(mv):
            take = min(self.chunk_bytes - self._fill, len(mv) - pos)
            self._crc = zlib.crc32(mv[pos:pos + take], self._crc)  # releases the GIL on big buffers
            self._fill += take
            pos += take
            if self._fill == self.chunk_bytes:
                self.crcs.append(self._crc)
                self._crc, self._fill = 0, 0

    def finish(self) -> list[int]:
        """The list of chunk CRCs (an empty stream has one CRC, of zero bytes)."""
        if self._fill or not self.crcs:
            self.crcs.append(self._crc)
            self._crc, self._fill = 0, 0
        return self.crcs


def iter_chunks(path: Path, chunk_bytes: int, limit: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of each checksum chunk of the first ``limit`` bytes of ``path``."""
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < limit:
            data = f.read(min(chunk_bytes, limit - off))
            if not data:
                raise TableFormatError(path, off, f"truncated: ends at byte {off}, expected {limit}")
            yield off, data
            off += len(data)
