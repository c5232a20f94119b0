"""Arguments a subcommand cannot use are refused by its parser, naming the flag, before anything loads."""

from __future__ import annotations

import pytest

from dmltrain.service.cli import main as cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # 0 was read as "not given": a full 64 px set, or the default 12 faces, without a word
        (
            ["prepare", "glyphs", "/nonexistent/g", "--image-size", "0"],
            "--image-size: must be an integer of at least 8",
        ),
        (
            ["prepare", "glyphs", "/nonexistent/g", "--min-faces", "0"],
            "--min-faces: must be an integer of at least 2",
        ),
        (
            ["prepare", "glyphs", "/nonexistent/g", "--max-classes", "0"],
            "--max-classes: must be an integer of at least 2",
        ),
        # pydantic's four-line error about eval.max_images, after the model had loaded
        (
            ["evaluate", "runs:/x/model", "/nonexistent", "--max-images", "1"],
            "--max-images: must be an integer of at least 2",
        ),
        # accepted: a batch of 0 or -3 ran, and a FAR of 5 or NaN failed only after every image was embedded
        (
            ["verify", "m", "t", "p", "--image-root", ".", "--batch-size", "0"],
            "--batch-size: must be a positive integer",
        ),
        (
            ["verify", "m", "t", "p", "--image-root", ".", "--far", "5"],
            "--far: must be a rate in [0, 1], got 5",
        ),
        (
            ["verify", "m", "t", "p", "--image-root", ".", "--far", "nan"],
            "--far: must be a rate in [0, 1], got nan",
        ),
    ],
)
def test_bad_arguments_are_refused_by_the_parser(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as parsed:
        cli(argv)
    assert parsed.value.code == 2
    assert message in capsys.readouterr().err


def test_a_sweep_summary_that_cannot_be_written_is_refused_before_any_trial(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The summary file was opened after every trial had run: a traceback at the end of a long sweep."""
    sweep = "configs/sweeps/quality_losses.yaml"  # not read: the summary is checked first
    assert cli(["sweep", sweep, "--summary", str(tmp_path / "missing" / "s.md")]) == 2
    assert (
        f"--summary {tmp_path / 'missing' / 's.md'} is in {tmp_path / 'missing'}, which does not exist"
        in (capsys.readouterr().err)
    )
    assert cli(["sweep", sweep, "--summary", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
