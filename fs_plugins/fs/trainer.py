"""`trainer.type: fsplug` — FS-LLM's LLMTrainer with its training hooks delegating to the
method's client procedure (`fs_plugins.run.client.ClientProcedure`), the way FS's own FedMeZO
trainer extends LLMTrainer. FS's hook pipeline (regulariser, monitors, wrappers) stays."""
from __future__ import annotations

import math

from federatedscope.core.trainers.context import CtxVar
from federatedscope.core.trainers.enums import LIFECYCLE, MODE
from federatedscope.llm.trainer.trainer import LLMTrainer

from fs_plugins.fs.wire import decode_tensors


class PluginTrainer(LLMTrainer):
    procedure = None      # set by PluginClient right after construction
    last_update = None    # the ClientUpdate of the latest local round

    def bind(self, procedure) -> None:
        self.procedure = procedure
        self.eval_times: dict = {}   # the seconds of the evaluation in progress

    def _hook_on_fit_start_numerical_precision(self, ctx):
        """Never `ctx.model.half()` (FS's train.is_enable_half): that would turn the adapters
        and the uploads into float16. The builder sets the precision: the frozen base in
        fsplug.model.dtype, every trainable tensor float32."""

    def _hook_on_fit_start_init(self, ctx):
        if ctx.cur_mode in (MODE.TRAIN, MODE.FINETUNE):
            steps = self.procedure.begin_round()
            ctx.optimizer, ctx.scheduler = self.procedure.optimizer, self.procedure.scheduler
            # the procedure owns the batch stream: one pass of `steps` batches per round
            ctx.num_train_epoch, ctx.num_train_batch = 1, steps
            ctx.num_train_batch_last_epoch, ctx.num_total_train_batch = steps, steps
        ctx.loss_batch_total = CtxVar(0., LIFECYCLE.ROUTINE)
        ctx.loss_regular_total = CtxVar(0., LIFECYCLE.ROUTINE)
        ctx.num_samples = CtxVar(0, LIFECYCLE.ROUTINE)

    def _run_epoch(self, hooks_set, run_step=-1):
        """A training round without a local step (Method.trains False: zero_shot) runs no
        batch: FS's context reads a batch count of 0 as unset and would count batches from
        the config."""
        if self.ctx.cur_mode in (MODE.TRAIN, MODE.FINETUNE) and not self.procedure.step_phases:
            return
        super()._run_epoch(hooks_set, run_step)

    def _hook_on_epoch_start(self, ctx):
        pass

    def _hook_on_batch_start_init(self, ctx):
        ctx.data_batch = CtxVar(self.procedure.next_batch(), LIFECYCLE.BATCH)

    def _hook_on_batch_forward(self, ctx):
        loss = self.procedure.compute_loss(ctx.data_batch)
        ctx.skip_this_batch = CtxVar(not bool(loss.isfinite()), LIFECYCLE.BATCH)
        ctx.loss_batch = CtxVar(loss, LIFECYCLE.BATCH)
        ctx.batch_size = CtxVar(int(ctx.data_batch['input_ids'].shape[0]), LIFECYCLE.BATCH)

    def _hook_on_batch_backward(self, ctx):
        self.procedure.optimise(ctx.loss_task)

    def _hook_on_batch_end(self, ctx):
        loss_value = ctx.loss_batch.item()
        self.procedure.record(loss_value, ctx.batch_size)
        if math.isfinite(loss_value):
            ctx.num_samples += ctx.batch_size
            ctx.loss_batch_total += loss_value * ctx.batch_size

    def _hook_on_fit_end(self, ctx):
        if ctx.cur_mode in (MODE.TRAIN, MODE.FINETUNE):
            self.last_update = self.procedure.end_round()
            ctx.eval_metrics = dict(self.last_update.metrics)

    def start_evaluation(self) -> None:
        """Before FS's client evaluates its splits: their seconds count from 0."""
        self.procedure.take_eval_times()
        self.eval_times = {}

    def evaluate(self, target_data_split_name='test'):
        """One split's metrics, with the seconds of every split evaluated since
        start_evaluation: FS's client merges the splits' dicts in order, so the merged row has
        the whole evaluation's eval_s (as the embedded runner's)."""
        metrics = self.procedure.evaluate(target_data_split_name)
        self.eval_times = {name: self.eval_times.get(name, 0.0) + seconds
                           for name, seconds in self.procedure.take_eval_times().items()}
        return {**metrics, **self.eval_times}

    def update(self, model_parameters, strict=False):
        """Server content (a personalised or shared state) goes through the method."""
        self.procedure.receive(decode_tensors(model_parameters))

    def get_model_para(self):
        if self.last_update is not None:
            return dict(self.last_update.shared)
        return self.procedure.method.shared_tensors(self.procedure.model,
                                                    self.procedure.trainable_names)
