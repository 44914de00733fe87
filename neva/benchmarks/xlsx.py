"""A one-sheet ``.xlsx`` writer (Office Open XML: a zip of XML parts) for the MMBench server's upload, which LLaVA
writes with ``pandas.DataFrame.to_excel(engine="openpyxl")``; neither is a dependency here.

Only what that upload holds: one worksheet ``Sheet1`` (pandas' default name), a header row, then text cells (inline
strings, so no shared-string table), integer cells, and empty cells (pandas' NaN). Readers that take openpyxl's output
(openpyxl, pandas, Excel) read these parts: the minimal package of ECMA-376 part 1 (content types, the package and
workbook relationships, the workbook, the sheet).
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from pathlib import Path
from xml.sax.saxutils import escape

Cell = str | int | None

_CONTENT_TYPES = """<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">
<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>
<Default Extension="xml" ContentType="application/xml"/>
<Override PartName="/xl/workbook.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.sheet.main+xml"/>
<Override PartName="/xl/worksheets/sheet1.xml" ContentType="application/vnd.openxmlformats-officedocument.spreadsheetml.worksheet+xml"/>
</Types>"""
_RELS = """<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">
<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/officeDocument" Target="xl/workbook.xml"/>
</Relationships>"""
_WORKBOOK = """<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<workbook xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships">
<sheets><sheet name="Sheet1" sheetId="1" r:id="rId1"/></sheets>
</workbook>"""
_WORKBOOK_RELS = """<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">
<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/worksheet" Target="worksheets/sheet1.xml"/>
</Relationships>"""


def column_name(i: int) -> str:
    """0 → A, 25 → Z, 26 → AA (a cell reference's column letters)."""
    name = ""
    i += 1
    while i:
        i, rest = divmod(i - 1, 26)
        name = chr(ord("A") + rest) + name
    return name


def _cell(ref: str, value: Cell) -> str:
    if value is None:
        return ""
    if isinstance(value, int) and not isinstance(value, bool):
        return f'<c r="{ref}"><v>{value}</v></c>'
    # XML 1.0 cannot carry most control characters; openpyxl refuses them too (IllegalCharacterError)
    text = "".join(ch for ch in str(value) if ch in "\t\n\r" or ord(ch) >= 0x20)
    return f'<c r="{ref}" t="inlineStr"><is><t xml:space="preserve">{escape(text)}</t></is></c>'


def write_xlsx(path: Path, header: Sequence[str], rows: Sequence[Sequence[Cell]]) -> Path:
    """``header`` then ``rows`` as ``Sheet1`` of a new workbook at ``path``."""
    lines = []
    for r, row in enumerate([list(header), *rows], 1):
        cells = "".join(_cell(f"{column_name(c)}{r}", v) for c, v in enumerate(row))
        lines.append(f'<row r="{r}">{cells}</row>')
    sheet = (
        '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
        '<worksheet xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main"><sheetData>'
        + "".join(lines)
        + "</sheetData></worksheet>"
    )
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", _CONTENT_TYPES)
        z.writestr("_rels/.rels", _RELS)
        z.writestr("xl/workbook.xml", _WORKBOOK)
        z.writestr("xl/_rels/workbook.xml.rels", _WORKBOOK_RELS)
        z.writestr("xl/worksheets/sheet1.xml", sheet)
    return path
