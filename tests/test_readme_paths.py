"""The README's commands and code can be pasted as they are: every path in them is relative (a pasted
``/nvme/ckpt`` makes directories at the filesystem root, or fails for want of permission)."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_code_uses_relative_paths():
    blocks = re.findall(r"```(?:bash|python|sh)\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    absolute = [m.group(0) for b in blocks for m in re.finditer(r"(?<![\w:/.])/(?:[\w.-]+/?)+", b)]
    assert not absolute, f"absolute paths in the README's code: {absolute}"
