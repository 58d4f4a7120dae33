// SPDX-License-Identifier: GPL-2.0
/*
 * burrow_lockup: a test-only module for hack/testhost's self-test. Loading
 * it spins on one CPU with preemption off for `seconds` seconds, so the
 * test host's own kernel reports a soft lockup, as it does when QEMU's
 * emulated SVM wedges a CPU. It never stays loaded.
 */
#include <linux/delay.h>
#include <linux/module.h>
#include <linux/preempt.h>

static int seconds = 60;
module_param(seconds, int, 0444);
MODULE_PARM_DESC(seconds, "how long to spin with preemption off");

static int __init burrow_lockup_init(void)
{
	int ms;

	pr_info("burrow_lockup: spinning %d s with preemption off\n", seconds);
	preempt_disable();
	for (ms = 0; ms < seconds * 1000; ms++)
		mdelay(1);
	preempt_enable();
	return -EAGAIN;
}
module_init(burrow_lockup_init);

MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("burrow test host self-test: provoke a soft lockup");
