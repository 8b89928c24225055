"""Simulated execution backend: charges each batch plan's time from a latency model, samples stand-in tokens.

KV cell accounting lives in the serving core (so "KV full", purges and n_batch halving happen here exactly as
on the real engine); this backend only turns a plan into a `StepCost` and the cost into seconds.
"""

from __future__ import annotations

from operator import itemgetter

from engine.core.types import BatchPlan, ForwardCall, StepResult
from sim.latency import LatencyModel, StepCost, decode_only_cost

_pos0 = itemgetter(3)      # Chunk.pos0


class SimBackend:
    """`execute(plan)`: predicted elapsed seconds and, per sampling slot, the task's next stand-in token.

    A task's tokens come from `task.user.reply` (precomputed, deterministic): index k = the k-th generated
    token. Past its end the sequence repeats, so the backend never runs dry.
    """

    def __init__(self, latency: LatencyModel, kv_bytes_per_token: int) -> None:
        self.latency = latency
        self.kv_bytes_per_token = kv_bytes_per_token
        # a model that prices the engine's layout (sim.latency_physical) gets StepCost.calls / kv_save_bytes
        self.wants_layout = bool(getattr(latency, "wants_layout", False))
        # optional: the time of a decode-only step from (n_seqs, attn_ctx), bit-equal to step_time_s of its cost
        # (not for a layout model: its decode cost depends on the slots' positions, not only their sum)
        self._decode_step_time_s = None if self.wants_layout else getattr(latency, "decode_step_time_s", None)
        # optional too: the time of a one-call step from its counts, bit-equal to step_time_s of its StepCost
        self._one_call_step_time_s = None if self.wants_layout else getattr(latency, "one_call_step_time_s", None)

    def cost(self, plan: BatchPlan) -> StepCost:
        if self.wants_layout:
            return self.layout_cost(plan)
        n_prefill = n_decode = n_seqs = attn = kv_read = n_calls = 0
        copy_tokens = shift_tokens = 0
        for p in plan.program:
            if type(p) is ForwardCall:
                chunks = p.chunks
                n_calls += 1
                n_seqs += len(chunks)
                # a decode token at pos0 attends (and reads) pos0 + 1 cells: summed over the decode chunks at once
                dec = [c[3] for c in chunks if not c[5]]          # pos0 of the chunks with is_prompt False
                n_dec = len(dec)
                d = sum(dec) + n_dec
                n_decode += n_dec
                attn += d
                kv_read += d
                if n_dec < len(chunks):
                    for _seq, _task, toks, pos0, _sf, is_prompt in chunks:
                        if is_prompt:
                            n = len(toks)
                            n_prefill += n
                            attn += n * pos0 + n * (n + 1) // 2
                            kv_read += pos0 + n
            else:
                k = p.kind
                if k == "cache_save" or k == "cache_load":
                    copy_tokens += p.n_tokens
                elif k == "seq_add":
                    shift_tokens += max(0, p.p1 - p.p0)
        if n_prefill == 0 and n_calls == 1 and not copy_tokens and not shift_tokens:
            return decode_only_cost(n_decode, attn)   # the exact cost fast-forward uses
        return StepCost(n_prefill, n_decode, n_seqs, attn, n_calls,
                        copy_tokens * self.kv_bytes_per_token, shift_tokens, kv_read)

    def layout_cost(self, plan: BatchPlan) -> StepCost:
        """`cost(plan)` plus the layout: each call's chunks as (seq, pos0, n_tokens), and the saved bytes."""
        n_prefill = n_decode = n_seqs = attn = kv_read = 0
        save_tokens = load_tokens = shift_tokens = 0
        calls = []
        for p in plan.program:
            if type(p) is ForwardCall:
                call = []
                n_seqs += len(p.chunks)
                for seq, _task, toks, pos0, _sf, is_prompt in p.chunks:
                    n = len(toks)
                    call.append((seq, pos0, n))
                    if is_prompt:
                        n_prefill += n
                        attn += n * pos0 + n * (n + 1) // 2
                        kv_read += pos0 + n
                    else:
                        n_decode += 1
                        attn += pos0 + 1
                        kv_read += pos0 + 1
                calls.append(tuple(call))
            else:
                k = p.kind
                if k == "cache_save":
                    save_tokens += p.n_tokens
                elif k == "cache_load":
                    load_tokens += p.n_tokens
                elif k == "seq_add":
                    shift_tokens += max(0, p.p1 - p.p0)
        bpt = self.kv_bytes_per_token
        return StepCost(n_prefill, n_decode, n_seqs, attn, len(calls), (save_tokens + load_tokens) * bpt,
                        shift_tokens, kv_read, tuple(calls), save_tokens * bpt)

    def admission_cost(self, ops, decode_pos: list[int], decode_seqs: list[int],
                       prompts: list[tuple[int, int, int]]) -> StepCost:
        """The StepCost `cost()` gives a plan of the KV operations `ops` then one call of a decode token for
        each slot of `decode_seqs` (context lengths `decode_pos`, in that order) followed by the prompt chunks
        `prompts` ((seq, pos0, n_tokens >= 1), in order): `ServerCore.admission_horizon`'s first step,
        priced without building its chunks."""
        copy_tokens, shift_tokens, save_tokens = _op_tokens(ops)
        n_dec = len(decode_pos)
        n_prefill, attn, kv_read = _admission_counts(sum(decode_pos) + n_dec, prompts)
        bpt = self.kv_bytes_per_token
        n_seqs = n_dec + len(prompts)
        if self.wants_layout:
            call = tuple([(s, p, 1) for s, p in zip(decode_seqs, decode_pos)]) + tuple(prompts)
            return StepCost(n_prefill, n_dec, n_seqs, attn, 1, copy_tokens * bpt, shift_tokens, kv_read, (call,),
                            save_tokens * bpt)
        return StepCost(n_prefill, n_dec, n_seqs, attn, 1, copy_tokens * bpt, shift_tokens, kv_read)

    def admission_time_s(self, ops, n_decode: int, decode_ctx: int, prompts: list[tuple[int, int, int]]) -> float:
        """`latency.step_time_s(admission_cost(ops, decode_pos, ..., prompts))` from the decode count and
        Σ decode_pos (`decode_ctx`) alone: bit-equal through the model's `one_call_step_time_s` (same terms,
        same order). Only for a model without the layout and with that method (`fast_admission`)."""
        copy_tokens, shift_tokens, _ = _op_tokens(ops)
        n_prefill, attn, kv_read = _admission_counts(decode_ctx + n_decode, prompts)
        return self._one_call_step_time_s(n_prefill, n_decode, attn, kv_read, copy_tokens * self.kv_bytes_per_token,
                                          shift_tokens)

    @property
    def fast_admission(self) -> bool:
        """`admission_time_s` can price an admission step (no layout; the model has `one_call_step_time_s`)."""
        return self._one_call_step_time_s is not None

    def execute(self, plan: BatchPlan) -> StepResult:
        tasks = plan.tasks
        program = plan.program
        if not tasks and not any(type(p) is ForwardCall for p in program):
            return StepResult(0.0, {})   # KV bookkeeping only (drops, clears): charged nothing
        if (not plan.n_prompt_tokens and len(program) == 1 and self._decode_step_time_s is not None
                and type(program[0]) is ForwardCall):
            # one call of decode tokens only, nothing else: what cost() makes decode_only_cost(n, Σ pos0 + 1)
            chunks = program[0].chunks
            n = len(chunks)
            elapsed = self._decode_step_time_s(n, sum(map(_pos0, chunks)) + n)
        else:
            elapsed = self.latency.step_time_s(self.cost(plan))
        try:                             # the k-th generated token is reply[k] ...
            sampled = {sid: task.user.reply[len(task.generated)] for sid, task in tasks.items()}
        except IndexError:               # ... and past the reply's end the reply repeats
            sampled = {}
            for sid, task in tasks.items():
                reply = task.user.reply
                sampled[sid] = reply[len(task.generated) % len(reply)]
        return StepResult(elapsed, sampled)

    def prefill_stretch_costs(self, decode_pos: list[int], prompt_pos0: int, take: int, k: int,
                              decode_seqs: list[int] | None = None, prompt_seq: int = 0) -> list[StepCost]:
        """The StepCost `cost()` gives each of k steps that decode one token for every slot whose context
        length is in `decode_pos` (growing by one per step) and add `take` prompt tokens of one slot from
        position `prompt_pos0` on (one call, no KV operations). With `wants_layout`, the layout needs the
        slots' sequence ids: `decode_seqs` (same order as decode_pos) and `prompt_seq`."""
        n_dec = len(decode_pos)
        dec0 = sum(decode_pos) + n_dec          # a decode token at pos0 attends (and reads) pos0 + 1 cells
        tri = take * (take + 1) // 2
        out = []
        if self.wants_layout:
            if decode_seqs is None or len(decode_seqs) != n_dec:
                raise ValueError("prefill_stretch_costs: the layout needs one sequence id per decoding slot")
            for j in range(k):
                pos0 = prompt_pos0 + j * take
                dec = dec0 + j * n_dec
                call = tuple((s, p + j, 1) for s, p in zip(decode_seqs, decode_pos)) + ((prompt_seq, pos0, take),)
                out.append(StepCost(take, n_dec, n_dec + 1, dec + take * pos0 + tri, 1, 0, 0, dec + pos0 + take,
                                    (call,), 0))
            return out
        for j in range(k):
            pos0 = prompt_pos0 + j * take
            dec = dec0 + j * n_dec
            out.append(StepCost(take, n_dec, n_dec + 1, dec + take * pos0 + tri, 1, 0, 0, dec + pos0 + take))
        return out

    def prefill_stretch_times_s(self, decode_pos: list[int], prompt_pos0: int, take: int, k: int,
                                decode_seqs: list[int] | None = None, prompt_seq: int = 0) -> list[float]:
        """`latency.step_time_s` of each of `prefill_stretch_costs(...)`, without building the StepCosts when
        the model can price the counts directly (`one_call_step_time_s`, bit-equal)."""
        f = self._one_call_step_time_s
        if f is None:
            step_time = self.latency.step_time_s
            return [step_time(c) for c in
                    self.prefill_stretch_costs(decode_pos, prompt_pos0, take, k, decode_seqs, prompt_seq)]
        n_dec = len(decode_pos)
        dec0 = sum(decode_pos) + n_dec
        tri = take * (take + 1) // 2
        out = []
        for j in range(k):                   # the counts of prefill_stretch_costs, step by step
            pos0 = prompt_pos0 + j * take
            dec = dec0 + j * n_dec
            out.append(f(take, n_dec, dec + take * pos0 + tri, dec + pos0 + take))
        return out

    @staticmethod
    def tokens_for(task, k: int) -> list[int]:
        """The next k stand-in tokens of a task (what k further execute() calls would sample)."""
        return standin_tokens(task, len(task.generated), k)


def standin_tokens(task, n0: int, k: int):
    """A task's stand-in tokens at generated positions n0 .. n0 + k - 1: the k-th generated token is
    reply[k], and past the reply's end the reply repeats (what execute() samples)."""
    reply = task.user.reply
    if n0 + k <= len(reply):
        return reply[n0:n0 + k]
    return [reply[(n0 + i) % len(reply)] for i in range(k)]


def _op_tokens(ops) -> tuple[int, int, int]:
    """Tokens copied to/from the RAM cache, re-rotated by shifts, and saved (the first two as `cost()` counts
    them) by the KV operations `ops`."""
    copy_tokens = shift_tokens = save_tokens = 0
    for p in ops:
        k = p.kind
        if k == "cache_save":
            copy_tokens += p.n_tokens
            save_tokens += p.n_tokens
        elif k == "cache_load":
            copy_tokens += p.n_tokens
        elif k == "seq_add":
            shift_tokens += max(0, p.p1 - p.p0)
    return copy_tokens, shift_tokens, save_tokens


def _admission_counts(dec: int, prompts) -> tuple[int, int, int]:
    """(n_prefill, attn_ctx, kv_read) of one call: decode tokens attending `dec` cells in all (Σ pos0 + 1),
    then the prompt chunks (seq, pos0, n)."""
    attn = kv_read = dec
    n_prefill = 0
    for _seq, pos0, n in prompts:
        n_prefill += n
        attn += n * pos0 + n * (n + 1) // 2
        kv_read += pos0 + n
    return n_prefill, attn, kv_read
