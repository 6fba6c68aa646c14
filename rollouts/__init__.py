"""Producing and scoring trajectories: records, prompts, rewards, shaping, rollout managers.

Import what you need from here: `from rollouts import AsyncRolloutManager, RolloutConfig,
load_prompt_jsonl, Sample`. Layers: `types`/`errors` (records) < `prompts`, `rewards`,
`shaping`, `groups` (pure filters, transforms, metrics) < `generate_fn` (one group: the
`GenerateFn` contract) < `multiturn`/`envs` (episodes) < `generation` (many groups, refill) <
`manager` (batches of groups) < `rollout_batches` (a stream of batches);
`tasks/` holds the synthetic tasks, `tools/` the tool parsers and executors.

This package imports neither torch nor httpx at top level, so orchestration code that only
needs records and errors stays cheap to import.
"""

from plumbing.errors import CheckpointError as CheckpointError
from plumbing.errors import ConfigError as ConfigError
from plumbing.errors import DataError as DataError
from plumbing.errors import EngineError as EngineError
from plumbing.errors import ModelLoadError as ModelLoadError
from plumbing.errors import RewardError as RewardError
from plumbing.errors import RolloutsError as RolloutsError
from rollouts.config import RolloutConfig as RolloutConfig
from rollouts.config import SamplingConfig as SamplingConfig
from rollouts.evaluation import evaluate_greedy as evaluate_greedy
from rollouts.generate_fn import GenerateFn as GenerateFn
from rollouts.groups import GroupFilter as GroupFilter
from rollouts.groups import SampleTransform as SampleTransform
from rollouts.groups import keep_all as keep_all
from rollouts.groups import keep_if_reward_varies as keep_if_reward_varies
from rollouts.judge import judge_reward as judge_reward
from rollouts.manager import AsyncRolloutManager as AsyncRolloutManager
from rollouts.prompts import PromptItem as PromptItem
from rollouts.prompts import load_prompt_jsonl as load_prompt_jsonl
from rollouts.rewards import RewardFn as RewardFn
from rollouts.rewards import exact_match_reward as exact_match_reward
from rollouts.rewards import vector_reward as vector_reward
from rollouts.rewards import weighted_sum as weighted_sum
from rollouts.rollout_batches import generate_rollout_batches as generate_rollout_batches
from rollouts.shaping import add_shaping as add_shaping
from rollouts.shaping import entropy_bonus as entropy_bonus
from rollouts.shaping import length_bonus as length_bonus
from rollouts.types import RolloutBatch as RolloutBatch
from rollouts.types import Sample as Sample
