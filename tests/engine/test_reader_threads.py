"""The reader under concurrent requests: a server answers requests in worker threads that share one
reader, so its document reads must give the same answers from many threads at once as from one
(pyarrow's Parquet reader crashes the process when two threads read one file object together).
Run in a child process so that a crash is a failed test, not a lost test run."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys, threading
import numpy as np
from prism_tda.engine.reader import IndexReader

index = sys.argv[1]
ref = IndexReader(index)
docs = np.arange(ref.n_docs)
want_ids = [ref.external_id(int(d)) for d in docs]
want_trained = ref.trained(docs)
ref.close()
for trial in range(40):
    reader = IndexReader(index)  # fresh: nothing cached, every thread reads the files
    errors, got = [], {}
    def work(i):
        try:
            if i % 2:
                got[i] = reader.trained(docs)
            else:
                got[i] = [reader.external_id(int(d)) for d in docs[i::3]]
        except Exception as e:
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    for i, v in got.items():
        if i % 2:
            assert np.array_equal(v, want_trained), trial
        else:
            assert v == want_ids[i::3], trial
    reader.close()
print("ok")
"""


def test_document_reads_from_many_threads_match_one_thread(index):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(index)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])
