// Included first by every header of aio/: those are the I/O layer's own and the engine's (aio/, src/). Outside
// the library only include/zoe/ is included; each layer's library is compiled with its ZOE_LAYER_<NAME>, and
// tests and benchmarks, which look inside, with ZOE_WHITE_BOX (docs/architecture.md, "Layers and folders").
#pragma once

#if !defined(ZOE_LAYER_AIO) && !defined(ZOE_LAYER_SRC) && !defined(ZOE_WHITE_BOX)
#error "a private header of aio/ is included from outside its layer: include only include/zoe/ (docs/architecture.md, \"Layers and folders\")"
#endif
