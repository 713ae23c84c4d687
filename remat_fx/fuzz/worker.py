"""One case of the command line, run in a worker process (spawned workers import it from here)."""


def run_one(job):
    seed, args = job
    import torch

    torch.set_num_threads(args.threads)
    from remat_fx.fuzz.oracle import check
    from remat_fx.fuzz.program import generate, render
    from remat_fx.fuzz.shrink import shrink

    if args.against == "pytorch":
        from remat_fx.fuzz.pytorch import check_pytorch, generate_for_pytorch

        program = generate_for_pytorch(seed)
        result = check_pytorch(program, backend=args.pytorch_backend)
        return seed, result, None, None, program.summary()
    program = generate(seed, mode=args.mode, inductor_share=args.inductor_share)
    result = check(program)
    original = shrunk = None
    if not result.ok:
        original = render(program, main=True)
        if args.shrink:
            try:
                small, small_result, _ = shrink(program, result, max_seconds=args.shrink_seconds)
                shrunk = render(small, main=True)
                result.detail += f" [shrunk to {len(small.ops())} ops: {small_result.detail}]"
            except Exception as e:  # the shrinker's own bug must not end the run
                result.detail += f" [shrinking failed: {type(e).__name__}: {e}]"
    return seed, result, original, shrunk, program.summary()
