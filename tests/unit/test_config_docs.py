"""docs/configuration.md's tables are the ones ``lightning_chunk/options.py`` generates (the one source)."""

from lightning_chunk.config_docs import DOC, main, render, tables


def test_the_configuration_page_is_current():
    current = DOC.read_text()
    assert render(current) == current, "run: python -m lightning_chunk.config_docs"
    assert main(["--check"]) == 0


def test_every_argument_and_group_field_has_a_row_with_its_meaning():
    rows = [line for line in tables().splitlines() if line.startswith("| `")]
    assert len(rows) == 12 + 14 + 6 + 5  # the arguments, then MemoryOptions, OffloadOptions, CheckOptions
    assert all(line.split(" | ")[2].strip() for line in rows)  # a meaning in every row
