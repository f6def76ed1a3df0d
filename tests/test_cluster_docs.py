"""docs/cluster.md holds only commands a test runs (tests/doc_commands.py): each command of its code
blocks is the literal text of a ``run_doc`` call in the tests, which runs it against the two-node SLURM."""

from __future__ import annotations

from doc_commands import PAGE, commands, run_by_tests


def test_every_command_of_the_cluster_guide_is_run_by_a_test():
    page = commands()
    assert "vitexp-sweep demo hydra/launcher=slurm" in page  # the guide's first sweep, as the README's demo
    not_run = [c for c in page if c not in run_by_tests()]
    assert not not_run, f"commands of {PAGE.name} no test runs (tests/test_slurm_cluster.py): {not_run}"


def test_the_guides_first_command_needs_no_path_and_no_gpu():
    """A new user's first command works as written: no placeholder, no data.root, no GPU for the CPU demo."""
    first = next(c for c in commands() if c.startswith("vitexp-sweep"))
    assert "<" not in first and "data.root" not in first and "gpu" not in first


def test_commands_are_read_from_bash_blocks_with_continuations_and_comments(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text `inline cmd`\n```bash\nsbatch a \\\n    b   # note\n# comment\n\nsqueue\n```\n"
        "```yaml\nkey: value\n```\n"
    )
    assert commands(page) == ["sbatch a b", "squeue"]
