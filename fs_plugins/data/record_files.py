"""Reading a user's record file: `.json` (a list of objects), `.jsonl` (one object per line) or
`.jsonl.gz`. Every problem is a DataFileError naming the file, the line (JSON lines) or the
record's index (a JSON list) and what to change."""
from __future__ import annotations

import gzip
import json
import zlib

from fs_plugins.core.errors import DataFileError

JSON_LINES_ENDINGS = ('.jsonl', '.jsonl.gz')
RECORD_FILE_ENDINGS = ('.json',) + JSON_LINES_ENDINGS
UTF8_BOM = '\ufeff'


class FileRecords(list):
    """The records of one file, in file order, knowing where each one is in the file."""

    def __init__(self, records, path: str, lines: list[int] | None = None):
        super().__init__(records)
        self.path = path
        self.lines = lines   # 1-based line of each record (JSON lines), None for a JSON list

    def with_records(self, records) -> FileRecords:
        """Other records (e.g. renamed copies) at the same places in the same file."""
        return FileRecords(records, self.path, self.lines)

    def position(self, index: int) -> str:
        return f'line {self.lines[index]}' if self.lines is not None else f'list index {index}'

    def error(self, index: int, what: str, change: str) -> DataFileError:
        """'Record <index> of <file> <what> (<line or list index>): <change>'."""
        return DataFileError(f'Record {index} of {self.path} {what} ({self.position(index)}): '
                             f'{change}')


def is_json_lines(path: str) -> bool:
    return path.endswith(JSON_LINES_ENDINGS)


def file_bytes(path: str) -> bytes:
    """The file's bytes, gunzipped for .gz."""
    try:
        with open(path, 'rb') as handle:
            data = handle.read()
    except OSError as exc:
        raise DataFileError(f'Data file {path}: cannot be read ({exc.strerror}); check that it '
                            'is a readable file') from None
    if not path.endswith('.gz'):
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataFileError(f'Data file {path}: not a readable gzip file ({exc}); '
                            'replace it with an intact copy') from None


def decoded_text(data: bytes, path: str) -> str:
    """The bytes as UTF-8 text (a leading byte-order mark dropped); invalid bytes raise naming
    their line and byte offset."""
    try:
        text = data.decode('utf-8')
    except UnicodeDecodeError as exc:
        line = data.count(b'\n', 0, exc.start) + 1
        raise DataFileError(
            f'Data file {path}, line {line} (byte offset {exc.start}): not UTF-8 text '
            f'({exc.reason}: {data[exc.start:exc.end]!r}); save the file as UTF-8') from None
    return text[1:] if text.startswith(UTF8_BOM) else text


def _json_lines(text: str, path: str, blank_lines_ok: bool) -> FileRecords:
    lines = text.split('\n')
    if lines and lines[-1] == '':
        lines.pop()   # the newline that ends the last line
    records, numbers = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            if blank_lines_ok:
                continue
            raise DataFileError(f"Data file {path}, line {number}: blank line; FS-LLM's reader "
                                'takes one JSON object on every line: remove it')
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            hint = (' (a JSON list belongs in a .json file)' if number == 1
                    and line.lstrip().startswith('[') else '')
            raise DataFileError(f'Data file {path}, line {number}: not valid JSON ({exc.msg} at '
                                f'column {exc.colno}); each line must hold one JSON object'
                                f'{hint}') from None
        except (ValueError, RecursionError) as exc:
            raise unreadable_json_error(path, f'line {number}', exc) from None
        numbers.append(number)
    return FileRecords(records, path, numbers)


def _json_list(text: str, path: str) -> FileRecords:
    if not text.strip():
        raise empty_file_error(path)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataFileError(f'Data file {path}, line {exc.lineno} column {exc.colno}: not valid '
                            f'JSON ({exc.msg}); a .json data file holds one list of objects'
                            ) from None
    except (ValueError, RecursionError) as exc:
        raise unreadable_json_error(path, 'its JSON', exc) from None
    if not isinstance(records, list):
        raise DataFileError(f'Data file {path} holds a JSON {json_type(records)}, not a list of '
                            'records: write [{...}, {...}], or one object per line in a .jsonl '
                            'file')
    return FileRecords(records, path)


def unreadable_json_error(path: str, where: str, exc: Exception) -> DataFileError:
    """Valid JSON syntax that Python's reader still refuses (nesting too deep for its
    recursion, integers of more digits than its limit)."""
    reason = 'nested too deeply' if isinstance(exc, RecursionError) else str(exc)
    return DataFileError(f'Data file {path}, {where}: cannot be read ({reason}); records are '
                         'objects of text fields')


def empty_file_error(path: str) -> DataFileError:
    return DataFileError(f'Data file {path} holds no records: add some, or use another file')


def json_type(value) -> str:
    names = {dict: 'object', list: 'list', str: 'string', bool: 'true/false', type(None): 'null'}
    return names.get(type(value), 'number')


def read_record_file(path: str, blank_lines_ok: bool = True) -> FileRecords:
    """The records of a .json / .jsonl(.gz) file, each a JSON object (their fields are the
    caller's to check). blank_lines_ok=False: FS-LLM's reading, which has no blank lines."""
    if not path.endswith(RECORD_FILE_ENDINGS):
        raise DataFileError(f'Data file {path} must end in .json (a list of records) or .jsonl '
                            '(one record per line): rename it')
    text = decoded_text(file_bytes(path), path)
    records = (_json_lines(text, path, blank_lines_ok) if is_json_lines(path)
               else _json_list(text, path))
    if not records:
        raise empty_file_error(path)
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise records.error(index, f'is a JSON {json_type(record)}, not an object',
                                'write each record as {"field": value, ...}')
    return records


def check_text_fields(records: FileRecords, required: tuple[str, ...],
                      optional: tuple[str, ...] = ()) -> None:
    """Each record's `required` fields are present and strings; its `optional` ones, where
    present, strings or null."""
    for index, record in enumerate(records):
        # FS-LLM's readers make a missing field None: absent and null are the same to it
        missing = [name for name in required if record.get(name) is None]
        if missing:
            raise records.error(index, f'lacks field(s) {missing}',
                                'add them as strings (null counts as absent), or name the '
                                'fields the file uses in fsplug.data.fields')
        for name in required + optional:
            value = record.get(name)
            if value is not None and not isinstance(value, str):
                raise records.error(index, f"has '{name}' = {short(value)}, a JSON "
                                           f'{json_type(value)}',
                                    f"write it in quotes ('{name}' must be a string)")


def short(value, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 3] + '...'
