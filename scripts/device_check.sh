#!/usr/bin/env bash
# Every GPU check, for a session that is lent a device (docs/benchmarks.md, "On CUDA"). A session has
# 15 minutes of device time in all (start-up included), so the checks come in parts, the first the one
# that matters most, sized to leave time for a second call:
#     run(command="bash scripts/device_check.sh short", timeout_s=450)     # first: 5 min at most
#     run(command="bash scripts/device_check.sh executor", timeout_s=450)  # if time is left: 6.8 min at most
#     run(command="bash scripts/device_check.sh peers", timeout_s=520)     # or this: 8.3 min at most
#     run(command="bash scripts/device_check.sh inductor", timeout_s=400)  # or this: 6.2 min at most
#     run(command="bash scripts/device_check.sh inductor-peers", timeout_s=520)  # or this: 8.3 min at most
#     run(command="bash scripts/device_check.sh graph-breaks", timeout_s=300)  # or this: 4.5 min at most
#     run(command="bash scripts/device_check.sh rnn", timeout_s=300)  # or this: 4.5 min at most
#     run(command="bash scripts/device_check.sh zero-gradients", timeout_s=240)  # or this: 3.5 min at most
# short: exact gradients (float64, then float32), the allocator's peak against the prediction and
# step-time ratios on the zoo (cuda_check.py), beside the Gruslys target on the compiler path;
# first, what a BatchNorm's recomputation costs on the GPU (scripts/batch_norm_recompute.py, 30 s at most).
# executor: the rest, the Gruslys check on the executor, the executor's cost per op, the store-all step
# ratios. peers: `recompute-graph bench --peers --device cuda` on ResNet-50, GPT-2 small and U-Net at
# the sizes. inductor: the store-all step with the plan's graphs compiled by inductor
# (ResNet-50, GPT-2 small); inductor-peers: ResNet-50's peer table with inductor compiling our graphs
# and torch.compile's peer alike. compiler: the Gruslys check on the compiler path with a longer
# capture limit. graph-breaks: a user's torch.compile of models split by graph breaks (the halves, HF
# GPT-2, wav2vec2), whose graphs share the budget, by the caching allocator. rnn: an nn.LSTM planned step by
# step (unroll_rnns) against cuDNN's fused kernel (scripts/unrolled_lstm.py). zero-gradients: a GPT-2
# given labels at its real vocabulary, store-all on the compiler path against eager's peak, whose
# logits get no zero gradient (scripts/unreached_output_gradients.py). No argument: cuda_check,
# executor, peers, inductor, inductor-peers, compiler, graph-breaks, rnn and zero-gradients, one after the other, for a
# machine without those limits. Uses the device machine's own python3 (PyTorch with CUDA) and imports
# this working tree. Each check has its own time limit so that one slow check
# leaves the others their turn; outputs also go to $OUT.
set -uo pipefail
part="${1:-all}"
out="${OUT:-/tmp/device_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$out/device.txt"
# torch 2.11's Dynamo logs a traceback per compilation ("Unexpected exception logging compilation metrics":
# it sorts the set of functions our backend asks it not to trace); the lines starting E<date> are left out
quiet() { grep -v '^E[0-9][0-9][0-9][0-9] '; }
if [[ $part == short ]]; then
    # the Gruslys check plans for minutes on the CPU: it runs beside the zoo checks (whose step times it
    # slows; their memory and gradients are per process) and times its own steps after they end
    timeout 300 python3 scripts/bptt_gruslys.py --device cuda --steps 1000 --batch 512 --hidden 2048 --input 512 \
        --memory 0.05 --compiler > "$out/gruslys_cuda_compiler.md" 2>&1 &
    gruslys=$!
    # a BatchNorm recomputed from its statistics against the training kernel (times; equal bit for bit?)
    timeout 30 python3 scripts/batch_norm_recompute.py --device cuda 2>&1 | tee "$out/batch_norm_recompute_cuda.md"
    timeout 100 python3 scripts/cuda_check.py --dtype float64 --models resnet50 unet 2>&1 | quiet \
        | tee "$out/cuda_check_float64.md"
    timeout 130 python3 scripts/cuda_check.py 2>&1 | quiet | tee "$out/cuda_check.md"
    wait "$gruslys"
    quiet < "$out/gruslys_cuda_compiler.md"
fi
if [[ $part == all ]]; then
    timeout 200 python3 scripts/cuda_check.py 2>&1 | quiet | tee "$out/cuda_check.md"
fi
if [[ $part == all || $part == executor ]]; then
    timeout 100 python3 scripts/executor_overhead.py --device cuda --rounds 10 2>&1 | tee "$out/executor_overhead_cuda.md"
    timeout 220 python3 scripts/bptt_gruslys.py --device cuda --steps 1000 --batch 512 --hidden 2048 --input 512 \
        --memory 0.05 2>&1 | tee "$out/gruslys_cuda.md"
    timeout 90 python3 scripts/store_all_step.py --device cuda --models resnet50 gpt2 --rounds 5 2>&1 \
        | tee "$out/store_all_step_cuda.md"
fi
if [[ $part == all || $part == peers ]]; then
    # the peer table on the GPU: the compiler path at two budgets against per-block checkpointing,
    # checkpoint_sequential and torch.compile's activation_memory_budget, each model in one run
    bench=(python3 -m recompute_graph.cli bench --fractions 0.5 0.3 --solvers --peers --compiled --repeats 7
           --device cuda -q)
    timeout 200 "${bench[@]}" resnet50 --preset paper --size batch=8 2>&1 | quiet | tee "$out/peers_resnet50_cuda.md"
    timeout 150 "${bench[@]}" gpt2 --preset paper --size batch=2 --size seq_len=512 2>&1 | quiet \
        | tee "$out/peers_gpt2_cuda.md"
    timeout 150 "${bench[@]}" unet --preset small --size batch=2 --size image_size=256 --size width=32 2>&1 \
        | quiet | tee "$out/peers_unet_cuda.md"
fi
if [[ $part == all || $part == inductor ]]; then
    # the store-all step with the plan's graphs compiled by inductor (--inductor adds it, and
    # torch.compile(model), to the rows of eager, the default compiler path and aot_eager), then the
    # ResNet-50 peer table with inductor compiling our graphs and torch.compile's peer alike
    timeout 200 python3 scripts/store_all_step.py --device cuda --models resnet50 --rounds 5 --inductor 2>&1 \
        | quiet | tee "$out/store_all_step_inductor_resnet50_cuda.md"
    timeout 170 python3 scripts/store_all_step.py --device cuda --models gpt2 --rounds 5 --inductor 2>&1 \
        | quiet | tee "$out/store_all_step_inductor_gpt2_cuda.md"
fi
if [[ $part == all || $part == inductor-peers ]]; then
    # inductor compiles each row's graphs on the machine's CPUs: more than 200 s for this table
    timeout 500 python3 -m recompute_graph.cli bench --fractions 0.5 0.3 --solvers --peers --compiled \
        --graph-compiler inductor --repeats 7 --device cuda -q resnet50 --preset paper --size batch=8 2>&1 \
        | quiet | tee "$out/peers_inductor_resnet50_cuda.md"
fi
if [[ $part == all || $part == compiler ]]; then
    # the Gruslys target on the compiler path: >= 95 % of the activations saved at <= x1.33,
    # max_memory_allocated within 5 % of the prediction (capture of the 17,000-unit graph: minutes)
    timeout 420 python3 scripts/bptt_gruslys.py --device cuda --steps 1000 --batch 512 --hidden 2048 --input 512 \
        --memory 0.05 --compiler 2>&1 | tee "$out/gruslys_cuda_compiler.md"
fi
if [[ $part == all || $part == graph-breaks ]]; then
    # the step's graphs planned together (compile_backend): measured against the step plan and the budget
    timeout 260 python3 scripts/graph_break_budget.py --device cuda --models halves hf_gpt2 hf_wav2vec2 \
        --fraction 0.6 --on-infeasible floor 2>&1 | quiet | tee "$out/graph_breaks_cuda.md"
fi
if [[ $part == all || $part == rnn ]]; then
    timeout 260 python3 scripts/unrolled_lstm.py --device cuda --steps 100 200 --batch 256 2>&1 \
        | tee "$out/unrolled_lstm_cuda.md"
fi
if [[ $part == all || $part == zero-gradients ]]; then
    timeout 200 python3 scripts/unreached_output_gradients.py --device cuda 2>&1 | quiet \
        | tee "$out/unreached_output_gradients_cuda.md"
fi
