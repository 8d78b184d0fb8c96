"""The built-in tasks, one module each; every module here is imported by :func:`data.task.tasks`."""
