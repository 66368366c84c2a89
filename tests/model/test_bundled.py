"""A bundled demo model's training record points at this installation's demo corpus, wherever the
package was when the model was trained."""

from __future__ import annotations

from prism_tda import demo_corpus_path
from prism_tda.indexer.run import _relocated


def test_a_recorded_demo_corpus_of_another_installation_is_this_ones(tmp_path):
    assert _relocated("/elsewhere/site-packages/prism_tda/data/fortunes.jsonl.gz") == demo_corpus_path()
    other = tmp_path / "prism_tda" / "data" / "other.jsonl"
    assert _relocated(str(other)) == str(other)  # another missing file stays as recorded (the error names it)
    here = tmp_path / "prism_tda" / "data" / "fortunes.jsonl.gz"
    here.parent.mkdir(parents=True)
    here.write_text("")
    assert _relocated(str(here)) == str(here)  # a file that exists is the one read
