"""The training loop: `Trainer(config, explicit)` holds one run's state (model, params, optimizer state, RNG key,
step, data position, checkpoints, metrics log); `run()` trains to `config.steps`, checkpointing every
`save_every` steps and after the last, then plots, exports and prints the summary.

Nothing is written before every input has been checked (run_setup.py): a bad option, file or resume leaves the
output directory as it was.
"""
from __future__ import annotations

import json
import os
import time

import jax

from longstraw_jax import metrics, models, orbax_io, run_log, run_setup
from longstraw_jax.grpo import GRPOConfig
from longstraw_jax.run_config import RunConfig
from longstraw_jax.train import train_step


class Trainer:
    def __init__(self, config: RunConfig, explicit=frozenset()):
        """explicit: the options given on the command line (a resumed run's saved options must not contradict
        them)."""
        self.out = config.out or run_setup.default_out()
        self.config, self.checkpoints, saved = run_setup.open_resume(config, explicit, self.out)
        config = self.config
        self.mesh = run_setup.mesh_for(config)
        self.model, params = run_setup.load_model(config)
        if self.mesh is not None:
            self.model.sequence_parallel()  # a family without a sharded path says so here
        self.params = run_setup.place(params, self.mesh)
        self.data = run_setup.data_source(config, self.model.config.vocab_size)
        self.grpo = GRPOConfig(loss_agg=config.loss_agg, kl_coef=config.kl_coef)
        self.optimizer = run_setup.optimizer(config.lr, config.weight_decay, config.max_grad_norm or None)
        if saved is None:
            run_setup.check_no_checkpoints(self.out)
        # committed like the params: a jit output built from an uncommitted init would be committed after step 1
        # and recompile the step once more
        self.opt_state = run_setup.place(jax.jit(self.optimizer.init)(self.params), self.mesh, self.params)
        self.key = jax.random.key(config.seed)
        self.step, self.data_position = 0, 0
        if saved is not None:
            self.params, self.opt_state, self.key, meta = self.checkpoints.restore(self.params, self.opt_state)
            self.step, self.data_position = meta["step"], meta["data_position"]
        # every input checked: from here on the output directory is written
        os.makedirs(self.out, exist_ok=True)
        if self.checkpoints is None:
            self.checkpoints = orbax_io.TrainCheckpoints(self.out)
        self.log = metrics.MetricsLog(os.path.join(self.out, "metrics.jsonl"))
        self.log.keep_until(self.step)
        if saved is None:
            with open(os.path.join(self.out, "config.json"), "w") as f:
                json.dump(config.saved(), f, indent=2)

    def train_one(self) -> dict:
        """One step: a batch from the data source, one train_step, one metrics.jsonl line (returned)."""
        start = time.perf_counter()
        batch, extra = self.data.batch(self.model, self.params, self.key, self.step, self.data_position)
        sampled = time.perf_counter()
        self.params, self.opt_state, step_metrics = train_step(
            self.model, self.params, self.opt_state, batch, self.optimizer, self.grpo, self.config.mode,
            self.config.chunk_size, **({"mesh": self.mesh} if self.mesh is not None else {}))
        step_metrics = jax.device_get(step_metrics)
        done = time.perf_counter()
        self.step += 1
        self.data_position += 1
        record = run_log.step_record(self.step, step_metrics, extra, batch, start, sampled, done)
        self.log.write(record)
        return record

    def run(self) -> int:
        config = self.config
        print(run_log.header(self))
        records = []
        wall = time.perf_counter()
        while self.step < config.steps:
            record = self.train_one()
            records.append(record)
            if self.step % config.log_every == 0 or self.step == config.steps:
                print(run_log.progress(record, config.steps), flush=True)
            if self.step % config.save_every == 0 or self.step == config.steps:
                self.checkpoints.save(self.step, self.params, self.opt_state, self.key, self.data_position,
                                      config.saved())
        wall = time.perf_counter() - wall
        self.checkpoints.close()
        history = metrics.read_metrics(self.log.path)
        metrics.plot_metrics(history, os.path.join(self.out, "metrics.png"),
                             title=f"GRPO ({config.mode}) on {self.data.description}")
        if config.export_hf:
            models.save_hf(self.model, self.params, config.export_hf)
        print(run_log.summary(records, history, wall, self))
        return 0
