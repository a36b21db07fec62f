"""Scheduling is pinned: every policy on the benchmark's four workloads (a twentieth of their
requests) and on uniform 128/128 (a tenth), at the benchmark's KV cache and at one small enough to
preempt, each step hashed by batchllm/perf/schedule_digest.py. A change that must leave scheduling alone keeps these digests
(`python -m batchllm.perf.schedule_digest` compares the full-size workloads)."""

from batchllm.perf.schedule_digest import bench_digests

SCALE = 0.05
BENCH_KV_TOKENS, SMALL_KV_TOKENS = 500_000, 20_000

# (workload, policy, KV blocks, decode_reserve_ratio): (steps, preemptions, schedule, counts digests)
PINNED = {
    ("micro:2000:200:16#1024", "batchllm", 31250, 1.0): (108, 0, "b35a333eace5de37", "844bf43ab8b40519"),
    ("micro:2000:200:16#1024", "vllm", 31250, 1.0): (109, 0, "37b5c9f7f9d0692e", "425c84a3287a6bd6"),
    ("micro:2000:200:16#1024", "sglang", 31250, 1.0): (110, 0, "a6110b1b786012e1", "4e091272af79b559"),
    ("micro:2000:200:16#1024", "simple", 31250, 1.0): (155, 0, "98d38a862d1833fd", "9eb4bf9eff4c8e0a"),
    ("micro:2000:200:16#1024", "batchllm", 1250, 1.0): (202, 0, "e3e19f2fcc72e393", "227801ab6a56db9b"),
    ("micro:2000:200:16#1024", "vllm", 1250, 1.0): (181, 12, "47167a6cb26d1819", "32b3575f2b5931ee"),
    ("micro:2000:200:16#1024", "sglang", 1250, 1.0): (213, 5, "a15d5832213a78c8", "e0a1ccec6eda2b77"),
    ("micro:2000:200:16#1024", "simple", 1250, 1.0): (709, 81, "d1bdc91c5ca5b2e8", "cb516cf830fcfc8a"),
    ("industrial#2000", "batchllm", 31250, 1.0): (129, 0, "31301b7486716aa9", "2e76573ee757649b"),
    ("industrial#2000", "vllm", 31250, 1.0): (130, 0, "5884e9eaa93579c2", "70d4d8c1f79dc5a4"),
    ("industrial#2000", "sglang", 31250, 1.0): (134, 0, "4b0909d647fa92ba", "11fa97d162184eb4"),
    ("industrial#2000", "simple", 31250, 1.0): (207, 0, "caaff40161e5f63f", "dbf84ed975cba609"),
    ("industrial#2000", "batchllm", 1250, 1.0): (414, 0, "d8242417652caa17", "1445c04e00baaa5a"),
    ("industrial#2000", "vllm", 1250, 1.0): (930, 3, "b8a5eb922fc21750", "8d6dfd43bb98b563"),
    ("industrial#2000", "sglang", 1250, 1.0): (437, 5, "818a1a5eb2299a27", "6894bc3d11d9c693"),
    ("industrial#2000", "simple", 1250, 1.0): (1317, 216, "26c08670f2879178", "a729329cf5f51e21"),
    ("micro:2000:1000:4#1024", "batchllm", 31250, 1.0): (138, 0, "2a152d99a136e668", "7ab82451f28439fb"),
    ("micro:2000:1000:4#1024", "vllm", 31250, 1.0): (138, 0, "9be446c9291cb81b", "68819d7c6b3a1e54"),
    ("micro:2000:1000:4#1024", "sglang", 31250, 1.0): (138, 0, "2c4e927e6d18a0cc", "dc77d4fface077ce"),
    ("micro:2000:1000:4#1024", "simple", 31250, 1.0): (175, 0, "cd25849e8d7063e4", "beee0a7ce2c11b10"),
    ("micro:2000:1000:4#1024", "batchllm", 1250, 1.0): (510, 0, "983f123e0cc9d420", "7735f7e51159016c"),
    ("micro:2000:1000:4#1024", "vllm", 1250, 1.0): (808, 0, "a9122d63ce92b9c3", "125e760d6a3a6676"),
    ("micro:2000:1000:4#1024", "sglang", 1250, 1.0): (534, 0, "a941e108c040e11c", "1e89726671c745a5"),
    ("micro:2000:1000:4#1024", "simple", 1250, 1.0): (912, 8, "f7d7d8029be088e9", "57af27b16dad3875"),
    ("micro:16000:200:16#512", "batchllm", 31250, 1.0): (118, 0, "226806c668610080", "07195aa9af1a8db5"),
    ("micro:16000:200:16#512", "vllm", 31250, 1.0): (118, 0, "df45b40de2b37d75", "66aa9224bcc30738"),
    ("micro:16000:200:16#512", "sglang", 31250, 1.0): (119, 0, "c71812ce04b42d07", "250ff8283721415d"),
    ("micro:16000:200:16#512", "simple", 31250, 1.0): (306, 0, "b1f13e2742b0ab81", "484d30b028b308fa"),
    ("micro:16000:200:16#512", "batchllm", 1250, 1.0): (316, 0, "7e52ff0ea7b4610f", "d54010d6ca964569"),
    ("micro:16000:200:16#512", "vllm", 1250, 1.0): (1173, 0, "c047eb489847f47a", "c5659fe6a5751097"),
    ("micro:16000:200:16#512", "sglang", 1250, 1.0): (321, 2, "b1bd1551fd78c42f", "0406e9d1955dc05d"),
    ("micro:16000:200:16#512", "simple", 1250, 1.0): (2757, 1225, "1bda7ac5a87a3237", "97e1ff7450aac3de"),
    ("micro:2000:200:16#1024", "batchllm", 1250, 0.0): (177, 16, "184db82789cdc5e7", "b8e3bb4f23e8d20d"),
    ("industrial#2000", "batchllm", 1250, 0.0): (430, 29, "3a7b32dcebd48520", "773da44771a5678f"),
    ("micro:2000:1000:4#1024", "batchllm", 1250, 0.0): (510, 0, "646db7f629a06b3b", "68e6b72143bcc160"),
    ("micro:16000:200:16#512", "batchllm", 1250, 0.0): (263, 5, "6353f45d5fa08de8", "2c461974085c5680"),
}


def _digests() -> dict:
    runs = [(digest, 1.0) for digest in bench_digests((BENCH_KV_TOKENS, SMALL_KV_TOKENS), SCALE)]
    runs += [(digest, 0.0) for digest in bench_digests((SMALL_KV_TOKENS,), SCALE, policies=("batchllm",),
                                                        decode_reserve_ratio=0.0)]
    return {(d.workload, d.policy, d.num_kv_blocks, ratio): (d.num_steps, d.num_preemptions, d.schedule[:16],
                                                             d.counts[:16]) for d, ratio in runs}


def test_schedules_are_the_pinned_ones():
    digests = _digests()
    assert sum(preemptions for _, preemptions, _, _ in digests.values()) > 0
    assert {key for key, value in digests.items() if value != PINNED.get(key)} == set()
    assert digests.keys() == PINNED.keys()


# Requests that share nothing (the batchllm policy admits runs of them as arrays): a tenth of
# uniform 128/128, at a KV cache that preempts.
UNIFORM = "uniform:128:128#3000"
PINNED_UNIFORM = {
    ("batchllm", 1.0): (516, 0, "cd32556feb0f66b7", "bef7e52965fa5635"),
    ("vllm", 1.0): (455, 107, "affc35d930ec6d62", "433af2058b94cbe6"),
    ("sglang", 1.0): (549, 15, "220441252fd1c1dd", "3ef5105039443ba1"),
    ("simple", 1.0): (454, 125, "37990f1ea8898f10", "c742f5e8d75c94ed"),
    ("batchllm", 0.0): (454, 142, "9cbd740d03c3267a", "362217fff92ce815"),
}


def test_uniform_schedules_are_the_pinned_ones():
    runs = [(d, 1.0) for d in bench_digests((SMALL_KV_TOKENS,), 0.1, workloads=(UNIFORM,))]
    runs += [(d, 0.0) for d in bench_digests((SMALL_KV_TOKENS,), 0.1, workloads=(UNIFORM,), policies=("batchllm",),
                                             decode_reserve_ratio=0.0)]
    digests = {(d.policy, ratio): (d.num_steps, d.num_preemptions, d.schedule[:16], d.counts[:16]) for d, ratio in runs}
    assert digests == PINNED_UNIFORM
