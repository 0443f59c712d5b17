// The configuration reader is public API: zoe/config.h.
#pragma once

#include "zoe/config.h"
