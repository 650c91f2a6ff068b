/*
 * repro.h: what the libfabric-only reproducers of this directory share (each still
 * builds on its own: `cc -O1 NAME.c -o NAME -lfabric` here, or with -I pointing here).
 */
#ifndef OMPI_OFI_REPRO_H
#define OMPI_OFI_REPRO_H

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A libfabric call that must return 0: else print it and its error and exit. */
#define CK(x)                                                                          \
    do {                                                                               \
        int r_ = (int)(x);                                                             \
        if (r_) {                                                                      \
            printf("%s = %d (%s)\n", #x, r_, fi_strerror(-r_));                        \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

/* Seconds on the monotonic clock. */
static inline double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The domain of the last repro_open (for memory registrations). */
static struct fid_domain *repro_domain __attribute__((unused));

/*
 * Open an RDM endpoint of provider `prov` with capabilities `caps` (and message order
 * `order` both ways when not 0), FI_CONTEXT mode and no memory-registration mode,
 * bound to a new completion queue of format `fmt` and a new address vector (map).
 * The endpoint is not enabled yet. Returns the provider's fi_info.
 */
static inline struct fi_info *repro_open(const char *prov, uint64_t caps, uint64_t order,
                                         enum fi_cq_format fmt, struct fid_ep **ep,
                                         struct fid_cq **cq, struct fid_av **av)
{
    struct fi_info *hints = fi_allocinfo(), *fi;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = caps;
    hints->fabric_attr->prov_name = strdup(prov);
    hints->mode = FI_CONTEXT;
    hints->domain_attr->mr_mode = 0;
    if (order) {
        hints->tx_attr->msg_order = order;
        hints->rx_attr->msg_order = order;
    }
    CK(fi_getinfo(FI_VERSION(1, 13), NULL, NULL, 0, hints, &fi));
    fi_freeinfo(hints);
    struct fid_fabric *fab;
    struct fid_domain *dom;
    struct fi_cq_attr ca = { .format = fmt };
    struct fi_av_attr aa = { .type = FI_AV_MAP };
    CK(fi_fabric(fi->fabric_attr, &fab, NULL));
    CK(fi_domain(fab, fi, &dom, NULL));
    repro_domain = dom;
    CK(fi_endpoint(dom, fi, ep, NULL));
    CK(fi_cq_open(dom, &ca, cq, NULL));
    CK(fi_av_open(dom, &aa, av, NULL));
    CK(fi_ep_bind(*ep, &(*cq)->fid, FI_TRANSMIT | FI_RECV));
    CK(fi_ep_bind(*ep, &(*av)->fid, 0));
    return fi;
}

#endif
