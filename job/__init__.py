"""The job's rules, apart from the transport (bus/): the job spec (fields, defaults, rules), the plan every host is
sent, and Horovod's assignment of ranks to hosts and slots."""
