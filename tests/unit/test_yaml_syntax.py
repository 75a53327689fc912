"""toolkit.core.yaml_syntax: the first broken YAML file of a folder, by file and line (Hydra's config folder and
lm-eval's --include-path read folders whose broken files they skip or blame on another file)."""

from __future__ import annotations

from toolkit.core import yaml_syntax


def test_first_broken_file_is_named_with_its_line(tmp_path):
    (tmp_path / "a.yaml").write_text("task: a\ncustom_dataset: !function utils.load\nlist: &x [1, 2]\nagain: *x\n")
    assert yaml_syntax.first_syntax_error(str(tmp_path)) is None  # tags and aliases are syntax, not errors
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yml").write_text("task: b\n  bad: [1\n")
    (tmp_path / "sub" / "c.yaml").write_bytes(b"task: \xff\n")
    assert (
        yaml_syntax.first_syntax_error(str(tmp_path))
        == f"{tmp_path}/sub/b.yml: line 2, column 6: invalid YAML (mapping values are not allowed here)"
    )
    assert yaml_syntax.syntax_error(str(tmp_path / "sub" / "c.yaml")).endswith(
        "not UTF-8 text (invalid start byte); save it as UTF-8"
    )
    assert yaml_syntax.yaml_files(str(tmp_path)) == [str(tmp_path / n) for n in ("a.yaml", "sub/b.yml", "sub/c.yaml")]
