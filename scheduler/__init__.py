from scheduler.scheduler import (
    PREEMPTION_MODES,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = ["PREEMPTION_MODES", "Scheduler", "SchedulerConfig", "SchedulerOutput", "ScheduledSequence"]
