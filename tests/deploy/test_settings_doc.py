"""docs/settings.md is generated from the settings class: every setting, its env name, default and
meaning; a test fails when the committed file drifts."""

from __future__ import annotations

from prism_tda.cli import main
from prism_tda.service.settings import Settings
from prism_tda.service.settings_doc import DEFAULT_PATH, render


def test_committed_settings_reference_matches_the_settings_class():
    assert DEFAULT_PATH.is_file(), "docs/settings.md is missing; run `prism settings-doc`"
    assert DEFAULT_PATH.read_text() == render(), "docs/settings.md is out of date; run `prism settings-doc`"
    assert main(["settings-doc", "--check"]) == 0


def test_every_setting_is_documented_with_env_name_default_and_meaning():
    text = render()
    for name, field in Settings.model_fields.items():
        assert field.description, f"Settings.{name} has no description"
        row = next(line for line in text.splitlines() if line.startswith(f"| `PRISM_{name.upper()}` |"))
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 4 and all(cells), row
    assert "| `PRISM_PORT` | `int` | `8000` |" in text


def test_check_fails_on_a_drifted_file(tmp_path):
    stale = tmp_path / "settings.md"
    stale.write_text(render().replace("PRISM_PORT", "PRISM_PROT"))
    assert main(["settings-doc", "--check", "--out", str(stale)]) == 1
    assert main(["settings-doc", "--out", str(stale)]) == 0 and stale.read_text() == render()
