def add_eval_commands(sub):
    pass
