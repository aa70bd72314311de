"""What a batch job reads: INPUT (a folder, a glob, a list file, a Parquet or JSONL table) as keyed images.

A job's INPUT is resolved once, before any work, into an `Input`: the ordered list of unique keys
(what each output line's "image" names, and what `--resume` matches on) and a lazy iterator of
sources (a path, or the encoded bytes of an image) in the same order. Keys are checked up front
because the whole run depends on them: an empty input or a key listed twice is refused with a
message saying what to fix, while a key whose image turns out unreadable only becomes an error line.

Nothing is skipped silently: an entry named like an image that cannot be read (a dangling symbolic
link, a link loop, a file without read permission, a link to a folder) and a sub-folder that cannot
be listed are keys like any other, and `check_readable` (run on each source before it is decoded)
makes each an ImageError naming the cause: an error line in its place.

Accepted INPUTs (relative paths inside a list, JSONL or Parquet file are relative to that file's folder):
- a folder: every entry with an image extension under it that is not a folder, recursively, plus
  every sub-folder that cannot be listed, sorted by path (links to folders are not followed, as
  `Path.rglob` does not: a link loop cannot make the walk endless);
- a glob (`photos/**/*.jpg`): what it matches except folders, sorted;
- one image file;
- a text file of paths, one a line (blank lines and `#` comments skipped);
- a `.jsonl` file: one object a line, the image as a path (column image/path/image_path/file/filename)
  or as base64 text (column image_bytes/image_base64/bytes);
- a `.parquet` file: a path column as above, a binary column (image/image_bytes/bytes), or a
  Hugging Face datasets image struct ({"bytes", "path"}).
`column` names the image column when the automatic choice is not the right one; `key_column` names
a column of keys (default: the path, else `row-N`).
"""

from __future__ import annotations

import base64
import binascii
import errno
import glob
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISDIR
from typing import Any

IMAGE_EXTENSIONS = frozenset(
    {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".jfif"}
)
PATH_COLUMNS = ("image", "path", "image_path", "file", "filename")
BYTES_COLUMNS = ("image", "image_bytes", "image_base64", "bytes")
KEY_COLUMNS = ("key", "id")
GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A source found unreadable when INPUT was read (a JSONL cell that is not base64): `check_readable`
    raises its reason as the line's ImageError, in its place, and the other lines go on."""

    reason: str


Source = str | bytes | Unreadable  # a path, an encoded image, or why a cell holds neither


class InputError(ValueError):
    """INPUT cannot be used (missing, empty, no image column, duplicate keys); the message says why."""


@dataclass(frozen=True, slots=True)
class Input:
    """Keyed images in input order: `keys[i]` names the i-th source that `sources()` yields."""

    keys: list[str]
    sources: Callable[[], Iterator[Source]]
    description: str  # for messages: "folder photos/ (1,204 images)"

    def __len__(self) -> int:
        return len(self.keys)

    def items(self) -> Iterator[tuple[str, Source]]:
        """(key, source) pairs in input order."""
        return zip(self.keys, self.sources(), strict=True)


def open_input(spec: str | Path, *, column: str | None = None, key_column: str | None = None) -> Input:
    """Resolve INPUT (see the module docstring); InputError when it cannot be used."""
    text = str(spec)
    path = Path(text)
    if path.is_dir():
        found = _input_of_paths(_folder_images(path), f"folder {text}")
        if not found.keys:
            raise InputError(
                f"INPUT folder {text} holds no image files ({', '.join(sorted(IMAGE_EXTENSIONS))}); "
                "point it at a folder of images"
            )
        return _unique(found)
    if not path.exists():
        if GLOB_CHARS & set(text):
            matches = sorted(p for p in glob.glob(text, recursive=True) if not Path(p).is_dir())
            if not matches:
                raise InputError(f"INPUT glob {text!r} matches no file; check the pattern and the folder")
            return _unique(_input_of_paths(matches, f"glob {text}"))
        raise InputError(f"INPUT {text} does not exist; give a folder, a glob, a list of paths or a table")
    suffix = path.suffix.lower()
    if suffix in IMAGE_EXTENSIONS:
        return _input_of_paths([text], f"image {text}")
    if suffix == ".parquet":
        return _unique(_parquet_input(path, column, key_column))
    if suffix in (".jsonl", ".ndjson"):
        return _unique(_jsonl_input(path, column, key_column))
    return _unique(_list_input(path))


def input_of_images(images: Iterable[Any] | dict[str, Any]) -> Input:
    """Images given in Python (for notebooks): a {key: image} dict, or a list of paths / images.

    A list's keys are the paths for str paths, the positions ("0", "1", ...) otherwise.
    """
    if isinstance(images, dict):
        keys, values = [str(k) for k in images], list(images.values())
    else:
        values = list(images)
        keys = [v if isinstance(v, str) else str(i) for i, v in enumerate(values)]
    if not values:
        raise InputError("no images given; pass a non-empty list or dict of images")
    return _unique(Input(keys, lambda: iter(values), f"{len(values)} images"))


# ---- paths ------------------------------------------------------------------------------------------------


def check_readable(source: Source) -> Source:
    """`source`, or an ImageError saying why the path cannot be read and what to do (the image loader
    would call a dangling link or a loop "not found", and could not name a folder it cannot list), or
    why a table's cell holds no image (`Unreadable`: invalid base64 would reach it as "empty bytes")."""
    if isinstance(source, Unreadable):
        from foveal import ImageError

        raise ImageError(f"{source.reason}, then run again with --resume --allow-changed to redo this line")
    if not isinstance(source, str):
        return source
    problem = _unreadable(source)
    if problem is not None:
        from foveal import ImageError  # the type of every other image that fails to load

        raise ImageError(f"{problem}, then run again with --resume --allow-changed to redo this line")
    return source


def _unreadable(path: str) -> str | None:
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        if os.path.islink(path):
            if error.errno == errno.ELOOP:
                return f"{path!r} is a symbolic link loop; point it at an image or remove it"
            return f"{path!r} is a dangling symbolic link (to {os.readlink(path)!r}); fix or remove it"
        if error.errno == errno.EACCES:
            return f"{path!r} cannot be reached (permission denied); make its folders readable"
        return None  # not there: the image loader says so
    if S_ISDIR(mode):
        try:
            with os.scandir(path):
                pass
        except OSError as error:
            return (
                f"folder {path!r} cannot be listed ({error.strerror}), so its images are not in this run; "
                "make it readable"
            )
        return f"{path!r} is a folder, not an image file; rename or remove it"
    if not os.access(path, os.R_OK):
        return f"cannot read {path!r}: permission denied; make it readable (chmod a+r)"
    return None


def _folder_images(folder: Path) -> list[str]:
    found: list[str] = []

    def visit(directory: str) -> None:
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except OSError as error:
            if directory == str(folder):
                raise InputError(
                    f"INPUT folder {folder} cannot be listed ({error.strerror}); make it readable"
                ) from None
            found.append(directory)  # a key of its own: an error line in its place
            return
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                visit(entry.path)
            elif Path(entry.name).suffix.lower() in IMAGE_EXTENSIONS:
                found.append(entry.path)

    visit(str(folder))
    return sorted(found)


def _input_of_paths(paths: list[str], what: str) -> Input:
    return Input(list(paths), lambda: iter(paths), f"{what} ({len(paths)} images)")


def _list_input(path: Path) -> Input:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, OSError) as error:
        raise InputError(
            f"INPUT {path} is not a text file of image paths ({error}); give a folder, a glob, a list of "
            "paths, a .jsonl or a .parquet file"
        ) from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise InputError(f"INPUT {path} lists no image paths; write one path a line")
    folder = path.parent
    sources = [str(folder / key) for key in keys]  # absolute keys stay absolute (Path's / rule)
    return Input(keys, lambda: iter(sources), f"list {path} ({len(keys)} images)")


# ---- tables -----------------------------------------------------------------------------------------------


def _jsonl_input(path: Path, column: str | None, key_column: str | None) -> Input:
    rows, line_numbers = [], []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(
                    f"INPUT {path} line {number} is not JSON ({error}); fix or remove it"
                ) from None
            if not isinstance(row, dict):
                raise InputError(f"INPUT {path} line {number} is not a JSON object; write one object a line")
            rows.append(row)
            line_numbers.append(number)
    if not rows:
        raise InputError(f"INPUT {path} has no rows; write one JSON object a line")
    name = column or _pick(rows[0].keys(), PATH_COLUMNS + BYTES_COLUMNS, path)
    as_bytes = _is_bytes_column(name)
    values = [_cell(row, name, path, n) for n, row in enumerate(rows)]
    keys = _keys(
        values, as_bytes, [row.get(key_column or _key_name(rows[0].keys())) for row in rows], key_column
    )
    folder = path.parent

    def sources() -> Iterator[Source]:
        for value, number in zip(values, line_numbers, strict=True):
            yield (
                _b64(value, f"INPUT {path} line {number} column {name!r}")
                if as_bytes
                else str(folder / value)
            )

    return Input(keys, sources, f"JSONL {path} ({len(keys)} images)")


def _parquet_input(path: Path, column: str | None, key_column: str | None) -> Input:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(
            "reading a Parquet INPUT needs pyarrow; pip install -e '.[ray]' in foveal's clone (or pyarrow)"
        ) from None
    try:
        table_file = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises its own ArrowInvalid / OSError
        raise InputError(f"INPUT {path} is not a readable Parquet file ({error})") from None
    names = table_file.schema_arrow.names
    name = column or _pick(names, PATH_COLUMNS + BYTES_COLUMNS, path)
    if name not in names:
        raise InputError(f"INPUT {path} has no column {name!r}; its columns: {', '.join(names)}")
    kind = _arrow_kind(table_file.schema_arrow.field(name).type)
    if kind is None:
        raise InputError(
            f"INPUT {path} column {name!r} holds {table_file.schema_arrow.field(name).type}, neither paths "
            "(string), image bytes (binary) nor an image struct {bytes, path}; name the image column with --column"
        )
    key_name = key_column or _key_name(names)
    key_values = table_file.read(columns=[key_name]).column(0).to_pylist() if key_name else None
    if kind == "path":
        paths = table_file.read(columns=[name]).column(0).to_pylist()
        keys = _keys(paths, False, key_values, key_column)
    else:
        keys = _keys([None] * table_file.metadata.num_rows, True, key_values, key_column)
    folder = path.parent

    def sources() -> Iterator[Source]:
        for record_batch in table_file.iter_batches(columns=[name], batch_size=256):
            for value in record_batch.column(0).to_pylist():
                if kind == "struct":
                    value = (
                        value["bytes"]
                        if value and value.get("bytes") is not None
                        else (value or {}).get("path")
                    )
                    yield value if isinstance(value, bytes) else str(folder / str(value))
                else:
                    yield value if kind == "bytes" else str(folder / str(value))

    return Input(keys, sources, f"Parquet {path} ({len(keys)} images)")


def _arrow_kind(arrow_type: Any) -> str | None:
    import pyarrow as pa

    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "path"
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return "bytes"
    if pa.types.is_struct(arrow_type) and arrow_type.get_field_index("bytes") >= 0:
        return "struct"
    return None


def _pick(names: Iterable[str], wanted: tuple[str, ...], path: Path) -> str:
    names = list(names)
    for name in wanted:
        if name in names:
            return name
    raise InputError(
        f"INPUT {path} has no image column (looked for {', '.join(dict.fromkeys(wanted))}; it has "
        f"{', '.join(map(str, names))}); name it with --column"
    )


def _key_name(names: Iterable[str]) -> str | None:
    names = list(names)
    return next((k for k in KEY_COLUMNS if k in names), None)


def _is_bytes_column(name: str) -> bool:
    """In JSONL, image bytes are base64 text in a column named for it (`image` itself holds paths)."""
    return name in BYTES_COLUMNS[1:] or name.endswith(("_bytes", "_base64"))


def _cell(row: dict, name: str, path: Path, number: int) -> Any:
    if name not in row or not isinstance(row[name], str):
        raise InputError(f"INPUT {path} row {number} has no text in column {name!r}; every row needs one")
    return row[name]


def _b64(value: str, where: str) -> bytes | Unreadable:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as error:  # an unreadable image: its line says why, the others go on
        return Unreadable(
            f"{where} is not valid base64 ({error}); write the image file's bytes as standard base64 "
            "(RFC 4648: A-Z a-z 0-9 + /, padded with =, no line breaks)"
        )


def _keys(
    values: list[Any], as_bytes: bool, key_values: list[Any] | None, key_column: str | None
) -> list[str]:
    if key_values is not None and any(v is not None for v in key_values):
        return [str(v) for v in key_values]
    if key_column:
        raise InputError(f"--key-column {key_column!r} is not a column of INPUT (or holds no values)")
    if as_bytes:
        return [f"row-{n}" for n in range(len(values))]
    return [str(v) for v in values]


def _unique(found: Input) -> Input:
    seen: dict[str, int] = {}
    for position, key in enumerate(found.keys):
        if key in seen:
            raise InputError(
                f"{found.description} names {key!r} twice (items {seen[key] + 1} and {position + 1}); "
                "keys must be unique, since each output line and --resume match on them"
            )
        seen[key] = position
    return found
