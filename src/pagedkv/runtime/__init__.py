"""The CPU model runtime: how a model's dense work runs on the CPU (`linear`, `products`,
`decode`), the compiled code it runs (`matvec`, `stack`, `atomics`), where that code is
cached (`kernel_cache`), the thread policy (`threads`) and the knobs (`tuning`). Imports
nothing here: `threads`, `kernel_cache` and `tuning` are standard library only, and every
layer may import them alone (see docs/architecture.md)."""
