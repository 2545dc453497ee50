"""tests/naive.py's textbook algorithms equal the production paths (pure Python: well under a second)."""
from __future__ import annotations

import naive
import pp_schedules as S


def test_textbook_1f1b_equals_the_general_schedule():
    """Every rank's compute order of pp_schedules.one_f_one_b, messages left out, is the textbook
    warm-up / steady / cool-down order, for m below, at and above p."""
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, p, p + 1, 2 * p, 3 * p + 1):
            for s in range(p):
                general = [(a.kind, a.microbatch) for a in S.one_f_one_b(m, s, p)
                           if isinstance(a, S.Action)]
                assert general == naive.one_f_one_b(m, s, p), (m, s, p)
