"""The vexact sampler for vLLM's model runner v2 (the default GPU runner of vLLM 0.26 and 0.33), and its hook.

The hook: runner v2 asks the model for its state class (`get_model_state_cls`: `VexactModelState`,
vLLM's default state with one change) and, after loading, offers the state its freshly built
`Sampler` (`ModelState.custom_sampler`): the state returns `VexactSamplerV2`, carrying over the
base sampler's per-request states (temperatures, seeds, logprob settings, filled by the runner's
`add_request`).
Per step, on the rows the runner samples (one per request; prefill chunks that end mid-prompt are
sampled and discarded, as in stock vLLM), `kernels.sample_tokens` computes:
1. log_probs = kernels.log_softmax(logits, tau): the fp32 lm_head logits divided once by the
   request's temperature (tau < 1e-5 is greedy, scored at 1), fp32 log-softmax with a fixed block
   order. The trainer calls the same function, so the returned log-prob is its value.
2. the token: greedy rows take argmax(log_probs); the others Gumbel-max with noise keyed by (request
   seed, absolute position of the new token, token id), the same key as the V1 sampler: a request
   samples the same tokens alone, in any batch, chunked or after preemption.
3. when the batch asks for log-probs: the sampled token's log-prob and rank (vLLM's `>=` count), from
   the same expression without writing the [B, V] log-probs (output "token_log_probs"), or, for top-k
   log-probs or `logprob_token_ids`, the log-probs themselves (output "log_probs"), gathered as vLLM's
   `compute_topk_scores` lays them out, with a top-k whose ties go to the lower id
   (`logprobs.topk_scores`: a gather, no arithmetic).
Prompt log-probs: prompt_logprobs.py (the same function at temperature 1, the same top-k and rank).
Top-k, top-p and min-p (vLLM's per-request states, filled from the request or the checkpoint's
generation_config) narrow which tokens Gumbel-max may draw through the batch-invariant threshold of
`kernels.sampling.truncation` (`rules.truncation`, on the log-probs of step 1 written out); the
returned log-prob stays the full-vocabulary one.

CUDA graphs (graphs.py): after vLLM's warm-up call, the lm_head and this sampler are
captured per padded batch size and replayed on the usual decode step (no truncation, at most 256
rows, no tensor parallelism, CUDA graphs on): the same kernels on the same inputs, so the same bits,
without their host time.

Nothing else of vLLM's sampling runs: no penalties, logit bias, bad words, structured outputs,
thinking budget, trace replay, watermark or sampling mask. Every request option is classified by the
allow-list of option_policy.py and the ones this sampler does not serve are refused at admission
(request_validation.py: `LLM.generate`, the OpenAI server and AsyncLLM all admit requests there),
the engine options at configuration time, so none reaches this sampler; the runner's own warm-up
requests, which set every option to exercise vLLM's kernels, are sampled here like any other.
"""

from __future__ import annotations

import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

from vexact_vllm.kernels import Sampled, gumbel_argmax, log_softmax, sample_tokens
from vexact_vllm.kernels.sampling.sample import DRAWS, OUTPUTS

from .graphs import SamplerGraphs
from .logprobs import topk_scores
from .rules import GREEDY_EPS, draw_tokens, truncates, truncation


def _tiny_temperatures(host_temperature) -> bool:
    """Whether a row asks for a temperature in (0, GREEDY_EPS): greedy for vLLM, zeroed before the
    log-prob kernels (which would score it at 0.01)."""
    return bool(((host_temperature > 0) & (host_temperature < GREEDY_EPS)).any())


class VexactSamplerV2(Sampler):
    graphs: SamplerGraphs | None = None

    @classmethod
    def from_base(cls, base: Sampler, model=None, use_graphs: bool = False) -> VexactSamplerV2:
        """This sampler over `base`'s request states (no state is rebuilt or copied). `model` (the
        vexact model) and `use_graphs` (vLLM's CUDA graphs are on): capture the lm_head and the
        sampler after the warm-up call (`_capture_graphs`)."""
        sampler = cls.__new__(cls)
        sampler.__dict__.update(base.__dict__)
        sampler.model, sampler.use_graphs = model, use_graphs
        return sampler

    def _capture_graphs(self, device: torch.device) -> None:
        """The lm_head and sampler graphs (graphs.py), handed to the model's compute_logits.
        Run once, in vLLM's profile run (so their memory is counted before the KV cache is sized)."""
        model = self.model
        if not self.use_graphs or model is None or device.type != "cuda" or getattr(model, "tp", None) is not None:
            return
        graphs = SamplerGraphs(
            model.lm_head_weight, self.sampling_states.max_num_reqs, config_n=model.lm_head_config_n
        )
        graphs.capture()
        self.graphs = model.sampler_graphs = graphs

    def _sample_graphed(self, logits, input_batch, host_temperature, draw, output) -> Sampled:
        """`sample_tokens` by a replay (the eager path's bits: graphs.py)."""
        states = self.sampling_states
        return self.graphs.sample(
            logits.shape[0],
            draw,
            output,
            temperature=states.temperature.gpu,
            seeds=states.seeds.gpu,
            req_index=input_batch.expanded_idx_mapping,
            positions=input_batch.positions,
            logits_index=input_batch.logits_indices,
            zero_tiny_temperatures=_tiny_temperatures(host_temperature),
        )

    def output_for(self, idx_np) -> str:
        """What the step's log-probs need (`kernels.sample_tokens`' output): "tokens" when no
        request of the batch asks for log-probs, "token_log_probs" when they ask for the sampled
        token's only (an RL rollout's `logprobs=0`), "log_probs" for top-k or `logprob_token_ids`."""
        top_k = self.sampling_states.max_num_logprobs(idx_np)  # NO_LOGPROBS: none asked
        if self.logprob_token_ids_state.max_num_token_ids(idx_np) > 0 or top_k > 0:
            return "log_probs"
        return "tokens" if top_k == NO_LOGPROBS else "token_log_probs"

    def _warm_up(self, logits, tau, seeds, positions) -> None:
        """vLLM's warm-up step: compile every kernel variant the eager path may launch (so no
        request waits for Triton), then capture the graphs."""
        for draw in DRAWS:
            for output in OUTPUTS:
                sample_tokens(logits[:1], tau[:1], seeds[:1], positions[:1], draw=draw, output=output)
        log_probs = log_softmax(logits[:1], tau[:1])  # truncated sampling's path, both draw variants
        gumbel_argmax(log_probs, seeds[:1], positions[:1])
        gumbel_argmax(log_probs, seeds[:1], positions[:1], torch.full_like(tau[:1], float("-inf")))
        self._kernels_warm = True
        self._capture_graphs(logits.device)

    def rows(self, input_batch, host_temperature) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, seed, position of the sampled token) per sampling row, on the device.

        The log-prob kernels score temperature 0 (greedy) at 1 and raise (0, MIN_TEMPERATURE) to
        it (`kernels.sampling.logprob.effective_temperature`); a temperature in (0, GREEDY_EPS), greedy for
        vLLM, would so be scored at 0.01, not 1, and is zeroed first. vLLM raises such requests to
        0.01 before any sampler sees them, so this is decided on the host copies and launches
        nothing on the usual step (the sampler runs eagerly every decode step: host time)."""
        idx = input_batch.expanded_idx_mapping
        temperature = self.sampling_states.temperature.gpu[idx]  # fp32 [B]
        if _tiny_temperatures(host_temperature):
            temperature = torch.where(temperature < GREEDY_EPS, torch.zeros_like(temperature), temperature)
        seeds = self.sampling_states.seeds.gpu[idx]  # int64 [B]
        positions = input_batch.positions[input_batch.logits_indices].long() + 1  # [B]
        return temperature, seeds, positions

    def __call__(self, logits: torch.Tensor, input_batch) -> SamplerOutput:
        num_nans = get_num_nans(logits) if self.compute_nans else None
        idx_np = input_batch.idx_mapping_np
        states = self.sampling_states
        host_temperature = states.temperature.np[idx_np]  # host copies: no sync
        host_greedy = host_temperature < GREEDY_EPS
        host_truncation = (states.top_k.np[idx_np], states.top_p.np[idx_np], states.min_p.np[idx_np])
        truncated = not host_greedy.all() and truncates(logits.shape[1], *host_truncation)
        output = self.output_for(idx_np)
        if not getattr(self, "_kernels_warm", False):
            self._warm_up(logits.float(), *self.rows(input_batch, host_temperature))
        if truncated:  # the threshold needs the log-probs written out
            result = self._sample_truncated(logits, input_batch, host_temperature, host_greedy, host_truncation)
            if output == "token_log_probs":
                output = "log_probs"
        else:
            draw = "greedy" if host_greedy.all() else "sampled" if not host_greedy.any() else "mixed"
            if self.graphs is not None and self.graphs.owns(logits):
                result = self._sample_graphed(logits, input_batch, host_temperature, draw, output)
            else:
                tau, seeds, positions = self.rows(input_batch, host_temperature)
                result = sample_tokens(logits.float(), tau, seeds, positions, draw=draw, output=output)
        sampled = result.tokens

        logprobs_tensors = None
        expanded = sampled.shape[0] != idx_np.shape[0]
        cu_num_logits = input_batch.cu_num_logits_np.tolist() if expanded else None
        if output == "token_log_probs":  # what compute_topk_scores returns for it, without [B, V]
            logprobs_tensors = LogprobsTensors(
                logprob_token_ids=sampled.unsqueeze(-1),
                logprobs=result.token_log_probs.unsqueeze(-1),
                selected_token_ranks=result.ranks,
                cu_num_generated_tokens=cu_num_logits,
            )
        elif output == "log_probs":
            num_logprobs = self.sampling_states.max_num_logprobs(idx_np)
            custom = self._logprob_token_ids(input_batch, idx_np)
            k = num_logprobs if num_logprobs != NO_LOGPROBS else 0
            logprobs_tensors = topk_scores(result.log_probs, k, sampled, cu_num_logits, *custom)

        num_sampled, num_rejected = get_num_sampled_and_rejected(
            input_batch.seq_lens.new_ones(input_batch.num_reqs),
            input_batch.seq_lens,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            self.req_states.prefill_len.gpu,
        )
        return SamplerOutput(
            sampled_token_ids=sampled.view(-1, 1),
            logprobs_tensors=logprobs_tensors,
            num_nans=num_nans,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )

    def _logprob_token_ids(self, input_batch, idx_np) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(ids [B, W], counts [B]) of the rows' `logprob_token_ids` (vLLM's per-request state; W the
        batch's largest count), or (None, None) when no row of the batch asks for them."""
        state = self.logprob_token_ids_state
        width = state.max_num_token_ids(idx_np)
        if width == 0:
            return None, None
        idx = input_batch.expanded_idx_mapping
        return state.token_ids.gpu[idx, :width], state.num_token_ids.gpu[idx]

    def _sample_truncated(self, logits, input_batch, host_temperature, host_greedy, host_truncation) -> Sampled:
        """Top-k / top-p / min-p in the batch: the log-probs written out, the threshold from them,
        then `draw_tokens` (greedy rows ignore the threshold)."""
        tau, seeds, positions = self.rows(input_batch, host_temperature)
        log_probs = log_softmax(logits.float(), tau)  # fp32 [B, V]
        greedy = tau < GREEDY_EPS if host_greedy.any() else None  # mixed only (truncated: not all greedy)
        idx = input_batch.expanded_idx_mapping
        states = self.sampling_states
        threshold = truncation(log_probs, lambda name: getattr(states, name).gpu[idx], *host_truncation)
        return Sampled(draw_tokens(log_probs, greedy, host_greedy, seeds, positions, threshold), log_probs=log_probs)


class VexactModelState(DefaultModelState):
    """Runner v2's model state for vexact models (the model's `get_model_state_cls`): vLLM's default
    state, whose `custom_sampler` hands back the vexact sampler over vLLM's. Prompt embeddings are
    not supported (vexact models embed the token ids themselves, as the trainer does): vLLM 0.32+
    refuses `--enable-prompt-embeds` for a state that says so, behind option_policy's refusal."""

    supports_prompt_embeds = False

    def custom_sampler(self, sampler):
        if self.vllm_config.speculative_config is not None:  # the model refuses it at build time
            raise ValueError("speculative decoding is not supported with --model-impl vexact")
        from vllm.config.compilation import CUDAGraphMode

        graphs_on = self.vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
        return VexactSamplerV2.from_base(sampler, self.model, use_graphs=graphs_on), None
