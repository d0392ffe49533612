from typer.testing import CliRunner

from drivetrain.trainer.cli import app

runner = CliRunner()


def test_no_arguments_shows_help():
    result = runner.invoke(app, [])
    assert "engines" in result.output and "rollouts" in result.output


def test_version_lists_installed_distributions():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert "drivetrain-engine-api 0.1.0" in result.output
    assert "drivetrain-trainer 0.1.0" in result.output


def test_plugin_tables(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    for command, title in (
        ("engines", "drivetrain.engines"),
        ("rollouts", "drivetrain.rollouts"),
        ("ckpt-engines", "drivetrain.ckpt_engines"),
    ):
        result = runner.invoke(app, [command])
        assert result.exit_code == 0, result.output
        assert title in result.output
    engines = runner.invoke(app, ["engines"]).output
    fake_row = next(line for line in engines.splitlines() if "│ fake" in line)
    assert "drivetrain-engine-api 0.1.0" in fake_row and fake_row.rstrip(" │").endswith("ok")


def test_cli_import_stays_light():
    """`drivetrain engines` must not pay for torch, transformers or Ray (seconds each)."""
    import subprocess
    import sys

    heavy = "{'torch', 'transformers', 'ray'}"
    code = f"import sys, drivetrain.trainer.cli; print(sorted({heavy} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
