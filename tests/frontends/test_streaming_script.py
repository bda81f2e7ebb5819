"""The scripted conversation stream: user turns are fed exactly, replies are the model's own greedy tokens, each
ends at a stop token or at max_reply (then the end-of-turn marker is fed), and the run ENDs after the last."""
from __future__ import annotations

import torch

from flexgen_h2o.frontends.streaming import ConversationScript
from flexgen_h2o.kv import EvictionConfig
from tests.helpers import greedy, make_engine, random_prompts, tiny_hf


def test_script_feeds_turns_collects_replies_and_ends():
    model = tiny_hf("llama-gqa")
    turns = random_prompts([6, 5, 7], seed=3)
    end_of_turn = [2, 1]
    engine = make_engine(model, eviction=EvictionConfig(policy="h2o", hh_size=4, recent_size=4,
                                                        position_rolling=True))
    script = ConversationScript(turns, end_of_turn, max_reply=4, stop_ids={0})
    recorded = engine.on_step_logits
    engine.on_step_logits = lambda t, seqs, logits: (recorded(t, seqs, logits), script.observe(t, logits[0]))
    out = engine.generate([script.prompt()], greedy(200), forced=[script])
    fed = out.token_ids[0]
    # rebuild what must have been fed: reply, then (marker if cut) + next turn, ...
    expected, pos, scored = [], 0, [0]
    for i, reply in enumerate(script.replies):
        assert 1 <= len(reply) <= 4
        assert fed[pos:pos + len(reply)] == reply
        greedy_ids = [int(engine.step_logits[0][pos + k].argmax()) for k in range(len(reply))]
        assert reply == greedy_ids                              # replies are the model's own choices
        expected += reply
        pos += len(reply)
        if i + 1 < len(turns):
            nxt = ([] if reply[-1] in {0} else end_of_turn) + turns[i + 1]
            assert fed[pos:pos + len(nxt)] == nxt
            expected += nxt
            pos += len(nxt)
            scored.append(len(nxt))                             # every fed user-turn token gets an NLL
    assert fed == expected and script.turn == len(turns)
    assert out.metrics["decode_steps"] == len(fed)              # stopped at END, far before 200 tokens
    assert [len(n) for n in script.nll] == scored              # turn 1 is the prompt: prefilled, not scored
    assert all(torch.isfinite(torch.tensor(n)).all() for n in script.nll if n)
