#!/usr/bin/env bash
# verl's own fully-async trainer, unchanged, training on a rollmesh fleet: the quick start's task
# (examples/data/quickstart.parquet, examples/quickstart_reward.py) run by
# verl.experimental.fully_async_policy.fully_async_main, with rollout served by the fleet of fleet.yaml.
#
#   examples/verl/run.sh [verl overrides...]     e.g. trainer.total_training_steps=20
#
# 1. writes the model (runs/verl/model), 2. starts the fleet (rollmesh up, logs in runs/verl/mesh),
# 3. runs verl with the rollmesh overrides `rollmesh up` prints, 4. stops the fleet.
# Two environments, as a verl user has them: ROLLMESH_PYTHON runs the fleet (default .venv/bin/python,
# scripts/install), VERL_PYTHON runs verl with the plugin (default .venv-verl/bin/python,
# scripts/install --pins verl; elsewhere: pip install "rollmesh[verl]" into verl's environment).
# Without a GPU (no nvidia-smi) verl's trainer runs on CPU through rollmesh_verl.cpu (docs/coming-from-verl.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROLLMESH_PYTHON=${ROLLMESH_PYTHON:-.venv/bin/python}
VERL_PYTHON=${VERL_PYTHON:-.venv-verl/bin/python}
RUN=runs/verl
mkdir -p "$RUN"

if [ ! -f "$RUN/model/config.json" ]; then
  "$ROLLMESH_PYTHON" -c 'import sys; from modeling.presets import save_preset; save_preset("tiny-llama", 0, sys.argv[1])' \
    "$RUN/model"
fi

"$ROLLMESH_PYTHON" -m launcher.cli up --config examples/verl/fleet.yaml --run-dir "$RUN/mesh" >"$RUN/up.log" 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
for _ in $(seq 360); do
  grep -q '^verl: ' "$RUN/up.log" && break
  kill -0 $up 2>/dev/null || { echo "run.sh: rollmesh up exited:" >&2; tail -20 "$RUN/up.log" >&2; exit 1; }
  sleep 0.5
done
grep -q '^verl: ' "$RUN/up.log" || { echo "run.sh: the fleet did not come up in 180 s (see $RUN/up.log)" >&2; exit 1; }
read -r -a mesh <<<"$(sed -n 's/^verl: //p' "$RUN/up.log")"
echo "run.sh: fleet up ($RUN/up.log); starting verl"

device=()
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
  export VERL_USE_EXTERNAL_MODULES=rollmesh_verl.cpu   # verl's trainer on CPU (and the plugin)
  device=(trainer.device=cpu +ray_kwargs.ray_init.num_gpus=1 actor_rollout_ref.model.use_remove_padding=false
          +actor_rollout_ref.model.override_config.attn_implementation=sdpa)
fi
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}

"$VERL_PYTHON" -m verl.experimental.fully_async_policy.fully_async_main \
  actor_rollout_ref.rollout.name=rollmesh \
  actor_rollout_ref.rollout.checkpoint_engine.backend=rollmesh \
  "${mesh[@]}" \
  actor_rollout_ref.model.path="$PWD/$RUN/model" \
  rollout.nnodes=1 rollout.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  trainer.nnodes=1 trainer.n_gpus_per_node=1 actor_rollout_ref.hybrid_engine=false \
  data.train_files=examples/data/quickstart.parquet data.val_files=examples/data/quickstart.parquet \
  data.max_prompt_length=64 data.max_response_length=8 data.train_batch_size=0 data.gen_batch_size=1 \
  actor_rollout_ref.rollout.prompt_length=64 actor_rollout_ref.rollout.response_length=8 \
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.calculate_log_probs=true \
  actor_rollout_ref.rollout.agent.num_workers=1 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.optim.lr=1e-3 \
  algorithm.adv_estimator=grpo actor_rollout_ref.actor.use_kl_loss=false algorithm.use_kl_in_reward=false \
  reward.custom_reward_function.path=examples/quickstart_reward.py reward.num_workers=1 data.dataloader_num_workers=0 \
  async_training.trigger_parameter_sync_step=1 async_training.staleness_threshold=0.5 \
  trainer.logger=[console] trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.total_epochs=2 ray_kwargs.ray_init.num_cpus=32 hydra.run.dir="$RUN/hydra" \
  "${device[@]}" "$@"
