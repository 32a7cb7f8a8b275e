// spindle-agent: the remote side of spindle::Runtime::ssh(). The bootstrap
// uploads this binary to a host that lacks it and runs it there; it serves
// the built-in names of <spindle/ssh.h>. A program that wants to serve more
// calls spindle::run_agent() with its own setup instead.
#include <spindle/ssh.h>

int main(int argc, char** argv) { return spindle::run_agent(argc, argv); }
