"""scripts/replay_adaptive.py's policies on hand-made recorded steps (no model): each committed token and each
millisecond counted as its definition says."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import replay_adaptive  # noqa: E402

TABLE = {1: 1.0, 2: 1.5, 4: 2.0}  # ms a step by verify width (G = 3: widths 1, 2, 4)
RUNS = [[(3, [0.9, 0.8, 0.7]), (0, [0.2, 0.1, 0.1]), (1, [0.6, 0.45, 0.3])]]  # (drafts accepted, block survival)


@pytest.mark.parametrize("policy,tokens,ms", [
    ("plain", 3, 3.0),  # one token a step
    ("fixed", 4 + 1 + 2, 6.0),  # every step the whole block: 1 + accepted
    ("fixed:2", 2 + 1 + 2, 4.5),  # one draft a step: 1 + min(accepted, 1)
    # survival >= 0.5: 3 drafts (W 4), none (W 1), 1 draft (W 2)
    ("early_stop:0.5", 4 + 1 + 2, 2.0 + 1.0 + 1.5),
    # >= 0.4: 3 drafts (W 4), none (W 1), 2 drafts: the next compiled width up, 4, commits 1 + 1
    ("early_stop:0.4", 4 + 1 + 2, 2.0 + 1.0 + 2.0),
])
def test_replay_counts_each_policy_s_tokens_and_time(policy, tokens, ms):
    assert replay_adaptive.replay(RUNS, TABLE, policy, 3) == pytest.approx(tokens / ms * 1e3)
