// attn/nn.hpp — the trainable layer on top of attention: layers with explicit
// forward/backward, a small transformer, optimizers, synthetic tasks,
// checkpoints and the training loop.
#pragma once

#include "attn/nn/layers.hpp"
#include "attn/nn/model.hpp"
#include "attn/nn/optim.hpp"
#include "attn/nn/tasks.hpp"
#include "attn/nn/train.hpp"
