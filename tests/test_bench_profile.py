"""scripts/bench_profile.py's pieces that need no trace: HLO op names -> phases, self times of nested events, busy time,
and which trace lines hold the ops (CPU threads, a GPU's op line)."""

import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_profile  # noqa: E402

_P = "jit(_generate_program)/while/body"
HLO = "\n".join([  # lines as XLA dumps them (optimized HLO, instruction = ... metadata={op_name=...})
    f'  %ynn_fusion.97 = f32[8,4096]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%fc.97, '
    f'metadata={{op_name="{_P}/verify/dot_general" stack_frame_id=826}}, backend_config={{}}',
    f'  ROOT %while.5 = (s32[]) while(%t), condition=%c, body=%b, metadata={{op_name="{_P}/draft/while"}}',
    f'  %iota_reduce_fusion = (f32[7]) fusion(%x), kind=kLoop, '
    f'metadata={{op_name="{_P}/draft/while/body/closed_call/pick/reduce"}}',
    '  %copy.1 = f32[4]{0} copy(%y)',
    '  %dot.3 = f32[2,2]{1,0} dot(%p, %q), metadata={op_name="jit(_generate_program)/jit(_dequantize_body)/dot"}',
])


def test_op_names_and_phases():
    names = bench_profile.op_names(HLO)
    assert names["ynn_fusion.97"].endswith("/verify/dot_general") and "copy.1" not in names
    assert [bench_profile.phase_of(names[k]) for k in ("ynn_fusion.97", "while.5", "iota_reduce_fusion", "dot.3")] \
        == ["verify", "draft", "draft", "other"]
    # the innermost phase wins: an append inside a step's commit scope is the append
    assert bench_profile.phase_of("jit(f)/while/body/commit/append_context/add") == "append_context"
    assert bench_profile.phase_of("jit(f)/while/body/drafter/add") == "other"  # a path part, not a substring
    # the serving slots trace their steps under jax.vmap: a scope there is named vmap(<scope>)
    assert bench_profile.phase_of("jit(step_rows)/while/body/closed_call/vmap(decode)/kda/dot_general") == "decode"
    assert bench_profile.part_of("jit(step_rows)/while/body/vmap(decode)/vmap(kda)/dot_general") == "kda"
    assert bench_profile.phase_of("jit(step_rows)/vmap(decoder)/add") == "other"


def test_self_times_subtract_directly_nested_events():
    # a loop [0, 100) holding a body op [10, 40) that holds [15, 25), and a later op [50, 60); then one at [120, 130)
    events = [(0, 100, "while"), (10, 30, "body"), (15, 10, "inner"), (50, 10, "later"), (120, 10, "after")]
    got = dict(bench_profile.self_times(events))
    assert got == {"while": 100 - 30 - 10, "body": 30 - 10, "inner": 10, "later": 10, "after": 10}
    phase, per_op, per_part = bench_profile.by_phase(
        [events + [(200, 5, "SlinkyThreadPool::Await")]],
        {"while": "x/draft/while", "body": "x/draft/y", "inner": "x/verify/moe/cond/dot", "later": "x/verify/z"})
    assert phase == {"draft": 60 + 20, "verify": 10 + 10, "other": 10, "wait": 5}
    assert sum(per_op.values()) == sum(phase.values()) == sum(per_part.values())
    assert per_part[("verify", "moe")] == 10 and per_part[("verify", "rest")] == 10
    assert bench_profile.part_of("jit(f)/while/body/verify/mla/kda_like/dot") == "mla"  # innermost part


def test_busy_is_the_union_of_the_lines_intervals():
    # two lines: [0, 10) and [5, 20) overlap -> 20; [30, 35) alone; a nested [31, 33) adds nothing; [40, 40) empty
    lines = [[(0, 10, "a"), (30, 5, "c"), (31, 2, "d")], [(5, 15, "b"), (40, 0, "e")]]
    assert bench_profile.busy_ns(lines) == 20 + 5
    assert bench_profile.busy_ns([]) == 0


def test_trace_lines_pick_cpu_threads_else_the_gpus_op_lines():
    ev = types.SimpleNamespace(start_ns=1, duration_ns=2, name="fusion.1")

    def plane(name, *lines):
        return types.SimpleNamespace(name=name, lines=[types.SimpleNamespace(name=n, events=[ev]) for n in lines])

    cpu = types.SimpleNamespace(planes=[plane("/host:CPU", "tf_XLAEigen/1", "python"), plane("/host:metadata")])
    gpu = types.SimpleNamespace(planes=[plane("/host:CPU", "python"),
                                        plane("/device:GPU:0", "XLA Modules", "XLA Ops", "Stream #7")])
    other = types.SimpleNamespace(planes=[plane("/device:GPU:0", "XLA Modules", "Stream #7", "Steps")])
    assert bench_profile.trace_lines(cpu) == ([[(1, 2, "fusion.1")]], ["/host:CPU / tf_XLAEigen/1"])
    assert bench_profile.trace_lines(gpu)[1] == ["/device:GPU:0 / XLA Ops"]
    assert bench_profile.trace_lines(other)[1] == ["/device:GPU:0 / Stream #7"]
