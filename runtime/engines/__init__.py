"""Engines: the one interface through which jobs train and generate.

`get_engine(name)` returns an object with:
    name, device
    describe() -> dict                      device model, software versions, base dtype, CPU threads (the
                                            state's history records it per process: what bit-identical needs)
    fit_threads()                           take up the thread count chosen for the job now (a resume keeps
                                            its recorded one: runtime.base.threads.keep); mlx: nothing to do
    train_session(model_dir, spec, init_tensors, opt, seed) -> a session with
        forward_backward(micro_batches: list[(ids, labels[, places])], total_targets, step) -> (loss_sum, tokens)
            accumulates gradients; abandonable (it touches only the gradients). An entry may
            be (ids, labels, places): the rows' places in the step (default: counted from 0
            over the call's micro-batches), which with the seed and step key LoRA dropout's
            masks (runtime.models.dropout), so a step's masks do not depend on how it is cut
        evaluate(micro_batches: list[(ids, labels)]) -> (loss_sum, targets)
                                            held-out loss: forward only, no gradient, dropout off
        apply(lr)                           the AdamW update (torch.optim.AdamW's formula on every engine)
        discard()                           drop accumulated gradients
        export() -> dict[str, np.ndarray]   engine-neutral float32: adapter.<name>, optim.<name>.exp_avg(_sq)
                                            (+ precision.loss_scale, precision.clean_steps on a float16 base;
                                            an engine ignores what it does not use)
        load(tensors, step)                 the reverse; step is AdamW's step count
        adapter() -> dict[str, np.ndarray]  canonical LoRA tensors
        merged_weights() -> dict[str, np.ndarray]  the checkpoint's own float32 tensors + scale * B @ A
        pad_id
        grad_checkpoint                     settable: recompute each decoder layer in backward
    load_model(model_dir, adapter=None) -> the engine's model; model.make_decoder(slots, max_len)
                                        gives the Decoder runtime.engines.generation's Generator drives
    generator(model_dir, tokenizer, adapter, slots, max_len) -> runtime.engines.generation.Generator
    peak_mem_gb() -> float                  the most memory held on the device since the engine was made
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimSpec:
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
